"""``RolloutBatch``: the padded batch handed to the trainer, with verl's attribute names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # [B, n, ...] padded per batch: n differs between batches
# [B, ..., P(+R)]: left-padded to the part's prompt width, which its longest rewritten context may widen
PROMPT_KEYS = ("prompts", "input_ids", "attention_mask", "position_ids")


@dataclass
class RolloutBatch:
    """Tensors in ``batch`` (a ``TensorDict`` of batch size B), per-sample Python objects in
    ``non_tensor_batch`` (name -> object array of length B) and batch-level ``meta_info``.

    A row is one segment of a trajectory (``agentloop.postprocess``): ``batch["segment_index"]`` is 0 where a
    trajectory starts, and its other rows follow it. The per-trajectory columns of ``non_tensor_batch`` repeat on
    each of its rows; ``last_segments()`` picks one row per trajectory."""

    batch: TensorDict
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    @property
    def num_trajectories(self) -> int:
        return int((self.batch["segment_index"] == 0).sum())

    def last_segments(self) -> np.ndarray:
        """A boolean mask of the rows that end a trajectory (one per trajectory, in order)."""
        return last_segments(self.batch["segment_index"]).numpy()

    @classmethod
    def concat(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches sample-wise (prompts left-padded and images padded to the widest part, prompts with the
        ``pad_token_id`` of the parts' ``meta_info``); ``meta_info`` is taken from the first part."""
        keys = parts[0].non_tensor_batch.keys()
        batches = _common_prompt_width([part.batch for part in parts], parts[0].meta_info.get("pad_token_id", 0))
        return cls(
            batch=torch.cat(_common_image_width(batches), dim=0),
            non_tensor_batch={key: np.concatenate([part.non_tensor_batch[key] for part in parts]) for key in keys},
            meta_info=dict(parts[0].meta_info),
        )


def _common_image_width(batches: list[TensorDict]) -> list[TensorDict]:
    """Batches whose dense-padded image tensors have the same width (``agentloop.postprocess``), so they concatenate."""
    for key in IMAGE_KEYS:
        if key not in batches[0].keys():
            continue
        width = max(batch[key].shape[1] for batch in batches)
        batches = [batch.copy() for batch in batches]  # shallow: the callers' batches keep their own width
        for batch in batches:
            batch[key] = torch.nn.functional.pad(batch[key], (0, 0, 0, width - batch[key].shape[1]))
    return batches


def _common_prompt_width(batches: list[TensorDict], pad_token_id: int) -> list[TensorDict]:
    """Batches left-padded to the widest prompt width among them (``PROMPT_KEYS``)."""
    width = max(batch["prompts"].shape[-1] for batch in batches)
    if all(batch["prompts"].shape[-1] == width for batch in batches):
        return batches
    padded = []
    for batch in batches:
        extra = width - batch["prompts"].shape[-1]
        batch = batch.copy()
        for key in PROMPT_KEYS:
            value = pad_token_id if key in ("prompts", "input_ids") else 0
            batch[key] = torch.nn.functional.pad(batch[key], (extra, 0), value=value)
        padded.append(batch)
    return padded


def trajectory_ids(segment_index: torch.Tensor) -> torch.Tensor:
    """Each row's trajectory, numbered 0, 1, ... in batch order, from the batch's ``segment_index``."""
    return torch.cumsum(segment_index == 0, 0) - 1


def trajectory_sizes(segment_index: torch.Tensor) -> list[int]:
    """How many rows (segments) each trajectory has, in batch order."""
    return torch.bincount(trajectory_ids(segment_index)).tolist()


def last_segments(segment_index: torch.Tensor) -> torch.Tensor:
    """True on each trajectory's last row: the row before the next trajectory's first, and the batch's last."""
    starts = segment_index == 0
    return torch.cat([starts[1:], torch.ones(1, dtype=torch.bool)]) if len(starts) else starts


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array that never turns nested lists into extra dimensions."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array
