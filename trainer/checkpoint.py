"""Checkpoints under ``trainer.default_local_dir``: ``global_step_N/`` directories, the newest named in
``latest_checkpointed_iteration.txt``; saving one, and finding and reading the one to resume from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from trainer.settings import RunSettings

LATEST = "latest_checkpointed_iteration.txt"
WORKERS = "workers"  # the FSDP ranks' sharded state inside global_step_N/
STATE = "trainer_state.json"


def step_of(checkpoint: Path) -> int:
    """N of a ``global_step_N`` directory."""
    return int(checkpoint.name.rsplit("_", 1)[1])


def save_checkpoint(
    output_dir: Path,
    step: int,
    save_workers: Callable[[Path, Path], object],
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write ``output_dir/global_step_N/`` and point ``LATEST`` at it; return the directory.

    ``save_workers(workers_dir, hf_dir)`` saves the ranks' sharded state and the policy as a Hugging Face
    checkpoint; ``state`` joins ``step`` in ``trainer_state.json``; ``keep`` > 0 keeps that many checkpoints.
    """
    directory = output_dir / f"global_step_{step}"
    hf = directory / "actor" / "huggingface"
    save_workers(directory / WORKERS, hf)
    tokenizer.save_pretrained(hf)
    (directory / STATE).write_text(json.dumps({"step": step, **state}))
    # written last and atomically: a run killed mid-save resumes from the previous checkpoint
    latest = output_dir / f".{LATEST}.tmp"
    latest.write_text(str(step))
    os.replace(latest, output_dir / LATEST)
    if keep:
        # only older steps go: a directory may still hold later ones from a run this one did not resume
        older = sorted(step_of(path) for path in output_dir.glob("global_step_*") if step_of(path) < step)
        for old in older[: max(0, len(older) - keep + 1)]:
            shutil.rmtree(output_dir / f"global_step_{old}")
    return directory


def checkpoint_to_resume(run: RunSettings, output_dir: Path) -> Path | None:
    """The ``global_step_N`` directory ``trainer.resume_mode`` points at; None: start fresh."""
    if run.resume_mode == "disable":
        return None
    if run.resume_mode == "resume_path":
        directory = Path(run.resume_from_path or "")
        if not (directory / STATE).exists():
            raise FileNotFoundError(
                f"trainer.resume_from_path={str(directory)!r} is not a global_step_N checkpoint directory"
            )
        return directory
    latest = output_dir / LATEST  # auto: the settings admit no other mode
    return output_dir / f"global_step_{latest.read_text().strip()}" if latest.exists() else None


def read_trainer_state(directory: Path) -> dict[str, Any]:
    """A checkpoint's ``step``, ``sampler_position``, ``untrained_rows`` and ``kl_coef`` (the last two absent from older checkpoints)."""
    return json.loads((directory / STATE).read_text())
