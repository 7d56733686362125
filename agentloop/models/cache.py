"""On-disk cache of built checkpoints, safe when several processes build the same one at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """Where built artifacts live: ``$AGENTLOOP_CACHE`` or ``~/.cache/agentloop``."""
    return Path(os.environ.get("AGENTLOOP_CACHE", Path.home() / ".cache" / "agentloop"))


def build_once(target: Path, build: Callable[[Path], None]) -> str:
    """Return ``target``, first running ``build(staging_dir)`` if no checkpoint is there yet.

    The build goes to a staging directory renamed into place atomically: concurrent builders race,
    one wins, the others discard their copy.
    """
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
