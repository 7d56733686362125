"""How a batch is cut for the FSDP ranks: into the ranks' slices and the mini-batches by trajectories (a trajectory's
rows, its segments, stay together), then into micro-batches of rows: a fixed number each, or packed by token count
(verl's ``use_dynamic_bsz``); and the weight of each in a gradient accumulated over them.

Every rank must run as many forward passes as the others (each one gathers the sharded parameters), and ranks with
as many trajectories may hold different numbers of rows: the ranks first agree on the largest count of
micro-batches any of them needs, and a rank that needs fewer runs stand-ins for the rest (one of its rows without
model tokens, which adds nothing). Token-packed ranks share their rows out over that many micro-batches of similar
token totals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict

from agentloop.batch import trajectory_sizes as segments_per_trajectory

STAND_IN = "stand_in"  # the key that marks a stand-in micro-batch (``micro_batch``)


def trajectory_sizes(batch: TensorDict) -> list[int]:
    """How many rows each trajectory of ``batch`` has, in order (one each in a batch without ``segment_index``)."""
    if "segment_index" not in batch.keys():
        return [1] * len(batch)
    return segments_per_trajectory(batch["segment_index"])


def split_trajectories(batch: TensorDict, trajectories: int) -> list[TensorDict]:
    """``batch`` in consecutive parts of ``trajectories`` trajectories each (the last may have fewer), with all their rows."""
    sizes = trajectory_sizes(batch)
    return list(batch.split([sum(sizes[start : start + trajectories]) for start in range(0, len(sizes), trajectories)]))


@dataclass(frozen=True)
class MicroBatching:
    """``size`` rows per micro-batch, or with ``dynamic`` about ``max_tokens`` tokens (prompt + response); read from
    their sections by ``trainer.rank_settings``."""

    size: int
    dynamic: bool = False
    max_tokens: int = 0

    def groups(self, batch: TensorDict, rows: list[int] | None = None) -> list[list[int]]:
        """Row indices of each micro-batch; each group in the batch's order, every row in one group. As many groups
        as on every other rank: an empty one for each stand-in (``micro_batch``) this rank runs. ``rows``: only these
        rows of ``batch`` (one LoRA adapter's, ``trainer.lora``), possibly none."""
        part = batch if rows is None else batch[torch.tensor(rows, dtype=torch.long)]
        if self.dynamic:
            lengths = part["attention_mask"].sum(-1).tolist()
            count = _largest_over_ranks(bins_needed(lengths, self.max_tokens))
            groups = balanced_groups(lengths, min(count, len(part)))
        else:
            groups = consecutive_groups(trajectory_sizes(part), self.size)
            count = _largest_over_ranks(len(groups))
        if rows is not None:
            groups = [[rows[index] for index in group] for group in groups]
        return groups + [[] for _ in range(count - len(groups))]

    def split(self, batch: TensorDict, device: Any, rows: list[int] | None = None) -> list[TensorDict]:
        """``batch`` (its ``rows``, with them) as micro-batches on ``device``, stand-ins included (``is_stand_in``)."""
        return [micro_batch(batch, group, device) for group in self.groups(batch, rows)]

    def score(
        self,
        batch: TensorDict,
        device: Any,
        score: Callable[[TensorDict], torch.Tensor],
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """``score`` of every micro-batch, back on CPU and in the batch's order (the stand-ins' dropped); with
        ``rows``, of those rows only (the others' scores 0)."""
        groups = self.groups(batch, rows)
        parts = [score(micro_batch(batch, group, device)).cpu() for group in groups]
        parts = [part for group, part in zip(groups, parts) if group]
        if not parts:  # no row to score here (none of this adapter's)
            return torch.zeros(batch["responses"].shape, dtype=torch.float32)
        scores = torch.zeros((len(batch), *parts[0].shape[1:]), dtype=parts[0].dtype)
        scores[torch.tensor([index for group in groups for index in group])] = torch.cat(parts)
        return scores


def micro_batch(batch: TensorDict, group: list[int], device: Any) -> TensorDict:
    """The rows ``group`` of ``batch`` on ``device``; for an empty group a stand-in, marked ``STAND_IN``: the batch's
    first row with its ``response_mask`` zeroed, so that its loss, a mean over no model token, and its gradient are 0."""
    if group:
        return batch[torch.tensor(group)].to(device)
    stand_in = batch[:1].clone()
    stand_in["response_mask"] = torch.zeros_like(stand_in["response_mask"])
    stand_in[STAND_IN] = torch.ones(1, dtype=torch.bool)
    return stand_in.to(device)


def is_stand_in(micro: TensorDict) -> bool:
    """Whether ``micro`` only keeps this rank's forward passes in step with the others' (``micro_batch``)."""
    return STAND_IN in micro.keys()


def consecutive_groups(trajectory_rows: list[int], size: int) -> list[list[int]]:
    """Consecutive row indices, at most ``size`` in a group, a trajectory's rows together where they fit (a
    trajectory that does not fit in what is left of a group starts the next): ``size`` rows each when every
    trajectory has one row."""
    groups: list[list[int]] = [[]]
    start = 0
    for rows in trajectory_rows:
        if groups[-1] and len(groups[-1]) + rows > size:
            groups.append([])
        for row in range(start, start + rows):
            if len(groups[-1]) == size:
                groups.append([])
            groups[-1].append(row)
        start += rows
    return [group for group in groups if group]


def bins_needed(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches of at most ``max_tokens`` tokens hold these rows (first fit, longest first);
    a row longer than ``max_tokens`` gets one to itself."""
    loads: list[int] = []
    for length in sorted(lengths, reverse=True):
        for index, load in enumerate(loads):
            if load + length <= max_tokens:
                loads[index] += length
                break
        else:
            loads.append(length)
    return len(loads)


def balanced_groups(lengths: list[int], count: int) -> list[list[int]]:
    """Row indices in ``count`` non-empty groups of similar token totals (longest first into the lightest)."""
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(count), key=lambda g: (loads[g], len(groups[g]), g))  # empty groups fill first
        groups[lightest].append(index)
        loads[lightest] += lengths[index]
    return [sorted(group) for group in groups]


def _largest_over_ranks(count: int) -> int:
    if not dist.is_initialized():
        return count
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    agreed = torch.tensor([count], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return int(agreed.item())


def micro_batch_weight(micro: TensorDict, mini: TensorDict, loss_agg_mode: str) -> float:
    """The factor on a micro-batch's loss so that the accumulated gradient is the whole mini-batch's.

    Each micro-batch's loss is a mean over its own tokens (``token-mean``) or over its sequences that have
    a model token (``seq-mean-token-sum`` / ``-mean``): weighting it by its share of the mini-batch's tokens
    or such sequences makes the sum the mini-batch's mean, whatever sizes the micro-batches have.
    ``seq-mean-token-sum-norm`` divides by a constant, not a count: micro-batches are weighted by their
    share of the sequences, as verl's gradient accumulation does.
    """
    if loss_agg_mode == "token-mean":
        return float(micro["response_mask"].sum()) / max(float(mini["response_mask"].sum()), 1.0)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):

        def rows(batch: TensorDict) -> float:
            return float((batch["response_mask"].sum(-1) > 0).sum())

        return rows(micro) / max(rows(mini), 1.0)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return len(micro) / len(mini)
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: no micro-batch weighting is defined for it")
