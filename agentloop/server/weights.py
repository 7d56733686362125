"""Weights on the wire: a state dict as raw byte arrays, which Ray moves without pickling tensor data.

Ray pickles a ``torch.Tensor`` through ``torch.save`` of its storage (bytes copied three times on the
way in, once more on the way out); a numpy array travels as an out-of-band buffer instead: one copy
into the object store, and a zero-copy read-only view on the receiving side.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch


@dataclass(frozen=True)
class PackedWeights:
    """``(name, dtype, shape, bytes)`` per tensor; bytes as a flat ``uint8`` array (so bfloat16 fits too)."""

    entries: list[tuple[str, str, tuple[int, ...], np.ndarray]]

    @classmethod
    def pack(cls, state_dict: Mapping[str, torch.Tensor]) -> PackedWeights:
        """Views of the tensors' bytes where they are contiguous on CPU already, copies otherwise."""
        return cls(
            [
                (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), _bytes_of(tensor))
                for name, tensor in state_dict.items()
            ]
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Tensors viewing the packed bytes (no copy): read-only memory when they come from the object store."""
        with warnings.catch_warnings():
            # The views are only read (copied into the model), so the store's memory may stay read-only.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {
                name: torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)
                for name, dtype, shape, data in self.entries
            }


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
