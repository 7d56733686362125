"""Asynchronous training: the rollout servers keep generating while the FSDP ranks train.

With ``async_training.max_staleness`` = K ≥ 1 the trainer reads its batches from a rollout stream
(``agentloop.streaming``): GRPO groups run continuously, up to K steps ahead (step s trains policy
version s - 1, and its groups may start from version s - 1 - K on), and each step takes
``data.train_batch_size`` finished groups: the first to finish, or its own rows' (``async_training.group_order``). With ``async_training.partial_rollout`` (the default) a
weight push interrupts the requests in flight: the servers load the new weights and the routers continue
each request from the tokens it has, so one trajectory may hold tokens of several versions (each
token's version is in ``rollout_policy_versions``). Without it, a push waits until no group is in flight
and every sample comes from one version. Either way no token lags the policy it trains by more than K
versions: a group that finished too late for that is regenerated, never trained on.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace

import torch

from agentloop.batch import RolloutBatch, trajectory_ids
from agentloop.policy_versions import UNKNOWN
from agentloop.settings.reading import Section
from agentloop.streaming import ORDERS
from trainer.rollout_correction import RolloutCorrection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncSettings:
    """``async_training.*``: how many policy versions a trained group may lag (0: synchronous), whether weight pushes
    interrupt the requests in flight, how many groups run ahead (None: ``(1 + max_staleness)`` batches' worth) and
    in which order finished groups are taken (``agentloop.streaming.ORDERS``)."""

    max_staleness: int = 0
    partial_rollout: bool = True
    buffer_groups: int | None = None
    group_order: str = "finished"

    @classmethod
    def from_section(cls, section: Section, batch_groups: int) -> AsyncSettings:
        """The settings of ``section`` (``async_training``) for batches of ``batch_groups`` GRPO groups
        (``data.train_batch_size``)."""
        if section.int("max_staleness") < 0:
            raise section.error(
                "max_staleness", "a lag in policy versions cannot be negative", "set it to 0 (synchronous) or more"
            )
        buffer = section.optional_int("buffer_groups")
        if buffer is not None and buffer < batch_groups:
            raise section.error(
                "buffer_groups",
                f"cannot hold one batch of {batch_groups} GRPO groups (data.train_batch_size)",
                f"set it to at least {batch_groups}, or null for (1 + max_staleness) batches",
            )
        return cls(
            section.int("max_staleness"),
            section.bool("partial_rollout"),
            buffer,
            section.str("group_order", ORDERS),
        )

    def for_run(
        self, free_cache_engine: bool, correction: RolloutCorrection
    ) -> tuple[AsyncSettings, RolloutCorrection]:
        """These settings as this run can use them, and the rollout correction it trains with.

        Servers that sleep while the ranks train (``free_cache_engine``: ``rollout.free_cache_engine=true``, the
        colocated layout) cannot generate meanwhile: the run then trains synchronously and says so. Samples of an
        older policy need the off-policy correction: without one configured, token-level truncated importance
        weights are turned on (decoupled PPO: clip against the re-scored old log-probs, weight by their ratio to
        the rollout's, truncated at ``rollout_is_threshold``).
        """
        if self.max_staleness and free_cache_engine:
            warnings.warn(
                f"async_training.max_staleness={self.max_staleness} needs the rollout servers awake while the ranks "
                "train, but actor_rollout_ref.rollout.free_cache_engine=true puts them to sleep then (the colocated "
                "layout); this run trains synchronously. Set free_cache_engine=false (servers and ranks on their own "
                "devices) to overlap.",
                stacklevel=2,
            )
            return replace(self, max_staleness=0), correction
        if self.max_staleness and not correction.uses_rollout_log_probs:
            logger.warning(
                "async training: algorithm.rollout_correction.rollout_is=token (threshold %g) corrects for the "
                "older policies that generated the samples",
                correction.rollout_is_threshold,
            )
            correction = replace(correction, rollout_is="token")
        return self, correction


def staleness_metrics(batch: RolloutBatch, trained_version: int, max_staleness: int) -> dict[str, float]:
    """How many policy versions the batch's trajectories lag the policy they train (mean, max, histogram), by each
    one's oldest token over all its segments (the batch's stamp where no token's version is known), and the share
    of trajectories whose tokens come from more than one version (``async/partial_share``)."""
    versions = batch.batch["rollout_policy_versions"]
    trajectory = trajectory_ids(batch.batch.get("segment_index", torch.zeros(len(batch), dtype=torch.long)))

    def per_trajectory(row_values: torch.Tensor, reduce: str) -> torch.Tensor:
        return row_values.new_zeros(int(trajectory[-1]) + 1).scatter_reduce(
            0, trajectory, row_values, reduce, include_self=False
        )

    known = versions != UNKNOWN
    newest = per_trajectory(versions.max(-1).values, "amax")  # UNKNOWN where no token's version is known
    oldest_token = per_trajectory(versions.masked_fill(~known, torch.iinfo(versions.dtype).max).min(-1).values, "amin")
    stamped = per_trajectory(
        torch.tensor([int(version) for version in batch.non_tensor_batch["policy_version"]]), "amin"
    )
    oldest = torch.where(newest != UNKNOWN, oldest_token, stamped)
    newest = torch.where(newest != UNKNOWN, newest, oldest)
    lags = trained_version - oldest
    if int(lags.max()) > max_staleness:  # the stream regenerates such groups; a bug if it happens
        raise RuntimeError(
            f"a trajectory lags {int(lags.max())} policy versions, more than async_training.max_staleness={max_staleness}"
        )
    metrics = {
        "async/staleness/mean": float(lags.float().mean()),
        "async/staleness/max": float(lags.max()),
        "async/partial_share": float((newest != oldest).float().mean()),
    }
    for lag in range(max_staleness + 1):
        metrics[f"async/staleness_histogram/{lag}"] = float((lags == lag).sum())
    return metrics
