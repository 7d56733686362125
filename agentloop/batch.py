"""``RolloutBatch``: the padded batch handed to the trainer, with verl's attribute names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # [B, n, ...] padded per batch: n differs between batches


@dataclass
class RolloutBatch:
    """Tensors in ``batch`` (a ``TensorDict`` of batch size B), per-sample Python objects in
    ``non_tensor_batch`` (name -> object array of length B) and batch-level ``meta_info``."""

    batch: TensorDict
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    @classmethod
    def concat(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        """Stack batches sample-wise (images padded to the widest part); ``meta_info`` is taken from the first part."""
        keys = parts[0].non_tensor_batch.keys()
        return cls(
            batch=torch.cat(_common_image_width([part.batch for part in parts]), dim=0),
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


def object_array(values: list[Any]) -> np.ndarray:
    """A 1-D object array that never turns nested lists into extra dimensions."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array
