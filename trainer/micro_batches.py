"""Micro-batches on an FSDP rank: a fixed number of samples each, or packed by token count (verl's
``use_dynamic_bsz``); and the weight of each in a gradient accumulated over them.

Every rank must run as many forward passes as the others (each one gathers the sharded parameters), so
token-packed ranks first agree on the largest count any of them needs, then share their samples out
over that many micro-batches of similar token totals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tensordict import TensorDict


@dataclass(frozen=True)
class MicroBatching:
    """``size`` samples per micro-batch, or with ``dynamic`` about ``max_tokens`` tokens (prompt + response)."""

    size: int
    dynamic: bool = False
    max_tokens: int = 0

    @classmethod
    def for_update(cls, section: DictConfig) -> MicroBatching:
        """The training micro-batches of an actor or critic section (``ppo_micro_batch_size_per_gpu``, ...)."""
        return cls(
            int(section.ppo_micro_batch_size_per_gpu),
            bool(section.get("use_dynamic_bsz", False)),
            int(section.get("ppo_max_token_len_per_gpu", 0)),
        )

    @classmethod
    def for_log_probs(cls, section: DictConfig, actor: DictConfig) -> MicroBatching:
        """A log-prob pass's micro-batches: ``rollout.log_prob_*`` (old log-probs) or ``ref.log_prob_*``;
        without a size of their own, the actor's."""
        size = section.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
        return cls(int(size), bool(section.log_prob_use_dynamic_bsz), int(section.log_prob_max_token_len_per_gpu))

    @classmethod
    def for_values(cls, critic: DictConfig) -> MicroBatching:
        """The critic's scoring micro-batches (``forward_micro_batch_size_per_gpu``, ...)."""
        return cls(int(critic.forward_micro_batch_size_per_gpu), bool(critic.use_dynamic_bsz), int(critic.forward_max_token_len_per_gpu))

    def groups(self, batch: TensorDict) -> list[list[int]]:
        """Sample indices of each micro-batch; each group in the batch's order, every sample in one group."""
        count = len(batch)
        if not self.dynamic:
            return [list(range(start, min(start + self.size, count))) for start in range(0, count, self.size)]
        lengths = batch["attention_mask"].sum(-1).tolist()
        return balanced_groups(lengths, min(_largest_over_ranks(bins_needed(lengths, self.max_tokens)), count))

    def split(self, batch: TensorDict, device: Any) -> list[TensorDict]:
        """``batch`` as micro-batches on ``device``."""
        return [batch[torch.tensor(group)].to(device) for group in self.groups(batch)]

    def score(self, batch: TensorDict, device: Any, score: Callable[[TensorDict], torch.Tensor]) -> torch.Tensor:
        """``score`` of every micro-batch, back on CPU and in the batch's order."""
        groups = self.groups(batch)
        parts = [score(batch[torch.tensor(group)].to(device)).cpu() for group in groups]
        scores = torch.empty((len(batch), *parts[0].shape[1:]), dtype=parts[0].dtype)
        scores[torch.tensor([index for group in groups for index in group])] = torch.cat(parts)
        return scores


def bins_needed(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches of at most ``max_tokens`` tokens hold these samples (first fit, longest first);
    a sample longer than ``max_tokens`` gets one to itself."""
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
    """Sample indices in ``count`` non-empty groups of similar token totals (longest first into the lightest)."""
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
