"""Reading the YAML lists of ``{class_name, ...}`` entries that tools and interactions are declared in.

Every error names the file, the entry and the field, and says what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hydra.utils import get_class


def read_entries(path: str, key: str, config_key: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, entry)`` for each mapping in the file's ``key`` list; ``where`` locates it in errors."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path!r} does not exist (actor_rollout_ref.rollout.{config_key})")
    document = yaml.safe_load(file.read_text()) or {}
    entries = document.get(key) if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a {key!r} list of {{class_name, config, ...}} entries")
    located = []
    for position, entry in enumerate(entries):
        where = f"{path}: {key}[{position}]"
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise ValueError(f"{where}: missing field 'class_name'")
        if not isinstance(entry.get("config") or {}, dict):
            raise ValueError(f"{where}.config: expected a mapping, got {entry['config']!r}")
        located.append((where, entry))
    return located


def entry_class(entry: dict[str, Any], where: str, base: type) -> type:
    """Import ``entry["class_name"]`` and check that it subclasses ``base``."""
    try:
        cls = get_class(entry["class_name"])
    except Exception as error:
        raise ValueError(f"{where}.class_name = {entry['class_name']!r} cannot be imported: {error}") from error
    if not issubclass(cls, base):
        raise ValueError(
            f"{where}.class_name = {entry['class_name']!r} is not a subclass of {base.__module__}.{base.__qualname__}"
        )
    return cls
