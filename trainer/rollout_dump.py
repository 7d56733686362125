"""``trainer.rollout_data_dir``: each step's rollout dump (``agentloop.dumps``), written on a background
thread so the next step does not wait for it."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from agentloop.batch import RolloutBatch
from agentloop.dumps import list_step_files, write_rollout_dump


class RolloutDumps:
    """Writes one step's dump while the next step runs; a failed write raises at the next ``submit`` or ``close``."""

    def __init__(self, directory: str | Path, tokenizer: PreTrainedTokenizerBase) -> None:
        self.directory = Path(directory)
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-dump")
        self._pending: Future[float] | None = None

    def drop_after(self, step: int) -> None:
        """Delete dumps of steps after ``step`` (and half-written ones): a run that starts over, or resumes
        from ``step``, rewrites them, and a viewer must not show a step of an older run as this one's."""
        for number, path in list_step_files(self.directory).items():
            if number > step and path.suffix == ".parquet":
                path.unlink()
        for path in self.directory.glob(".step_*.tmp"):
            path.unlink()

    def submit(self, step: int, batch: RolloutBatch, **token_arrays: torch.Tensor) -> float | None:
        """Start writing ``step``'s dump (the tensors must not change afterwards); return the seconds the
        previous step's dump took, or None when there was none."""
        seconds = self._finish()
        self._pending = self._executor.submit(self._write, step, batch, token_arrays)
        return seconds

    def _write(self, step: int, batch: RolloutBatch, token_arrays: dict[str, torch.Tensor]) -> float:
        start = time.perf_counter()
        try:
            write_rollout_dump(self.directory, step, batch, self.tokenizer, **token_arrays)
        except Exception as error:
            raise RuntimeError(
                f"writing the rollout dump of step {step} into {self.directory} failed: {error}"
            ) from error
        return time.perf_counter() - start

    def _finish(self) -> float | None:
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()

    def close(self) -> None:
        """Wait for the last dump (raising its error, if any) and stop the thread."""
        try:
            self._finish()
        finally:
            self._executor.shutdown()
