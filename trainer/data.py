"""Training data in verl's row format (parquet or jsonl): loading, checks, filtering and a resumable order.

Rows are checked with ``agentloop.rows.check_row``; empty or malformed data fails fast, naming the
file and the row.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pyarrow.parquet as pq

from agentloop.rows import check_row


def read_rows(path: str, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """All rows of one ``.parquet`` or ``.jsonl``/``.json`` file, each checked; the chat messages are read
    from the ``prompt_key`` column (verl's ``data.prompt_key``) into ``prompt``."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if file.suffix == ".parquet":
        rows = pq.ParquetFile(file).read().to_pylist()  # one file: read_table's dataset layer imports pandas (~0.3 s)
    elif file.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg})") from error
    else:
        raise ValueError(f"{path}: unsupported data format {file.suffix!r}; use .parquet or .jsonl")
    if not rows:
        raise ValueError(f"{path}: no rows")
    if prompt_key != "prompt":
        rows = [_with_prompt_from(row, prompt_key, f"{path}: row {index}") for index, row in enumerate(rows)]
    for index, row in enumerate(rows):
        check_row(row, f"{path}: row {index}")
    return rows


def _with_prompt_from(row: dict[str, Any], prompt_key: str, where: str) -> dict[str, Any]:
    if prompt_key not in row:
        raise ValueError(f"{where}: no {prompt_key!r} column (data.prompt_key); it has {sorted(row)}")
    row = dict(row)
    row["prompt"] = row.pop(prompt_key)  # one copy of the messages, under the name every agent loop reads
    return row


def load_dataset(
    files: str | list[str],
    *,
    prompt_length: Callable[[dict[str, Any]], int] | None = None,
    max_prompt_length: int | None = None,
    filter_overlong_prompts: bool = False,
    prompt_key: str = "prompt",
) -> list[dict[str, Any]]:
    """Rows of every file, in order (messages from the ``prompt_key`` column); rows whose prompt exceeds
    ``max_prompt_length`` tokens are dropped when ``filter_overlong_prompts`` (``prompt_length`` measures a
    row, e.g. with the chat template)."""
    rows = [row for path in ([files] if isinstance(files, str) else list(files)) for row in read_rows(path, prompt_key)]
    if filter_overlong_prompts:
        if prompt_length is None or max_prompt_length is None:
            raise ValueError("filter_overlong_prompts needs prompt_length and max_prompt_length")
        rows = [row for row in rows if prompt_length(row) <= max_prompt_length]
        if not rows:
            raise ValueError(f"every row of {files} is longer than data.max_prompt_length={max_prompt_length}")
    return rows


class BatchSampler:
    """Batches of ``batch_size`` rows in a seeded, per-epoch shuffled order, resumable from a checkpoint.

    ``batches(count)`` reads the next batches without moving; ``state(handed_out, untrained)`` is what a
    checkpoint records once some of them went out, and ``restore`` continues from it with the same order.
    Rows handed out but not trained (an async run's stream generates ahead) are replayed first, so a
    resumed run trains every row exactly once; dynamic sampling, which drops rows it generated, may leave a
    last replayed batch short. A last partial batch of an epoch is dropped. ``size_key`` names the batch size's
    config key in errors.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        size_key: str = "data.train_batch_size",
    ) -> None:
        if batch_size > num_rows:
            raise ValueError(f"{size_key}={batch_size} is larger than the dataset ({num_rows} rows)")
        self.num_rows, self.batch_size, self.shuffle, self.seed, self.size_key = (
            num_rows,
            batch_size,
            shuffle,
            seed,
            size_key,
        )
        self.position = 0  # batches of the order handed out before
        self.replay: list[int] = []  # rows to hand out first, whole batches
        self.batches_per_epoch = num_rows // batch_size

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def batch(self, position: int) -> list[int]:
        """The row indices of the batch at ``position`` of the order."""
        epoch, batch = divmod(position, self.batches_per_epoch)
        return self._order(epoch)[batch * self.batch_size : (batch + 1) * self.batch_size]

    def batches(self, count: int | None) -> Iterator[list[int]]:
        """The next ``count`` batches of row indices (None: without end, epoch after epoch): the replayed rows
        first, then the order."""
        replayed = [
            self.replay[start : start + self.batch_size] for start in range(0, len(self.replay), self.batch_size)
        ]
        ordered = (self.batch(self.position + k) for k in itertools.count())
        return itertools.islice(itertools.chain(replayed, ordered), count)

    def state(self, handed_out: int, untrained: Sequence[int] = ()) -> dict[str, Any]:
        """The checkpoint's data state once ``handed_out`` of ``batches``' batches went out and the rows
        ``untrained`` of them have not been trained yet."""
        replayed = -(-len(self.replay) // self.batch_size)  # batches, the last one possibly short
        return {
            "sampler_position": self.position + max(0, handed_out - replayed),
            "untrained_rows": [*untrained, *self.replay[handed_out * self.batch_size :]],
        }

    def restore(self, state: dict[str, Any], partial_replay: bool = False) -> None:
        """Continue from a checkpoint's ``state`` (older checkpoints have no ``untrained_rows``); with
        ``partial_replay`` (a reader that takes rows as they come: a stream, dynamic sampling) the rows to replay
        need not make whole batches."""
        replay = [int(index) for index in state.get("untrained_rows", [])]
        if len(replay) % self.batch_size and not partial_replay:
            raise ValueError(
                f"the checkpoint left {len(replay)} rows to train, not whole batches of {self.size_key}="
                f"{self.batch_size}: resume with the batch size it was saved with"
            )
        self.position, self.replay = int(state["sampler_position"]), replay
