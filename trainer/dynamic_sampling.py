"""Dynamic sampling (DAPO, Yu et al. 2025; verl's ``algorithm.filter_groups``): a GRPO group whose samples all score
the same has zero advantage everywhere and trains nothing, so it is dropped and more groups are generated in its
place.

A group's metric (``filter_groups.metric``) is taken per trajectory:

- ``score``: the trajectory's reward (its ``rm_scores``: what the reward function, or the loop's rewards, gave);
- ``seq_reward`` / ``seq_final_reward``: the score the trainer trains on, with the overlong penalty when
  ``reward_model.overlong_buffer`` is on (verl's token-level scores and rewards; a KL-in-reward penalty, which needs
  the ranks' log-probs, is not part of it here);
- any other name: that key of the trajectory's ``reward_extra_info`` (what a reward function returned beside the
  score; ``acc`` for a plain float, as in verl).

A group is kept when its metric varies over its trajectories (failed samples leave their group and are not counted),
and a group of one (``rollout.n=1``) is always kept, as in verl.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Collection

import numpy as np
import torch

from agentloop.batch import RolloutBatch
from agentloop.settings.reading import Section
from trainer.algorithms import trajectory_sums
from trainer.overlong import OverlongBuffer

SCORE_METRICS = ("score", "seq_reward", "seq_final_reward")


@dataclass(frozen=True)
class GroupFilter:
    """``algorithm.filter_groups`` as the trainer applies it."""

    metric: str
    # synchronous: generation batches per step at most; asynchronous: that many batches' worth of dropped groups
    # while one batch waits. <= 0: no limit
    max_num_gen_batches: int
    overlong: OverlongBuffer | None  # for seq_reward / seq_final_reward

    @classmethod
    def from_section(cls, filter_groups: Section, overlong: OverlongBuffer | None) -> GroupFilter | None:
        """The filter of ``filter_groups`` (``algorithm.filter_groups``), None when ``enable`` is off; ``overlong``:
        the run's overlong penalty, which ``seq_reward`` and ``seq_final_reward`` count."""
        if not filter_groups.bool("enable"):
            return None
        return cls(filter_groups.optional_str("metric") or "score", filter_groups.int("max_num_gen_batches"), overlong)

    def trajectory_metrics(self, rollout: RolloutBatch) -> np.ndarray:
        """The metric of each trajectory, in batch order (NaN for a failed one)."""
        last = rollout.last_segments()
        failed = np.asarray([failure is not None for failure in rollout.non_tensor_batch["failure"][last]])
        if self.metric in SCORE_METRICS:
            scores = trajectory_sums(rollout.batch["rm_scores"].sum(-1), rollout.batch["segment_index"])
            if self.metric != "score" and self.overlong is not None:
                scores = scores + self.overlong.penalties(rollout)
            values = scores.numpy().astype(float)
        else:
            infos = rollout.non_tensor_batch["reward_extra_info"][last]
            values = np.asarray(
                [np.nan if failed[index] else self._extra(info, index) for index, info in enumerate(infos)]
            )
        return np.where(failed, np.nan, values)

    def _extra(self, info: dict | None, trajectory: int) -> float:
        if not info or self.metric not in info:
            raise ValueError(
                f"algorithm.filter_groups.metric={self.metric!r}: trajectory {trajectory} of the batch has no {self.metric!r} in its "
                f"reward_extra_info (it has {sorted(info or {})}); choose one of {list(SCORE_METRICS)} or a key the reward "
                "function returns (acc: a plain float score)"
            )
        return float(info[self.metric])

    def informative(self, rollout: RolloutBatch) -> dict[str, bool]:
        """Each group (``uid``, in batch order): whether it is kept (its metric varies, or it is a group of one)."""
        values: dict[str, list[float]] = defaultdict(list)
        for uid, value in zip(
            rollout.non_tensor_batch["uid"][rollout.last_segments()], self.trajectory_metrics(rollout)
        ):
            values[uid].append(value)
        return {uid: len(group) == 1 or _varies(group) for uid, group in values.items()}

    def keeps(self, group: RolloutBatch) -> bool:
        """Whether a finished group's batch (the rollout stream's check) is kept."""
        return all(self.informative(group).values())

    def keep(self, rollout: RolloutBatch) -> tuple[RolloutBatch | None, int]:
        """The rows of ``rollout``'s informative groups (None: none is), and how many groups were dropped."""
        informative = self.informative(rollout)
        kept = [uid for uid, keep in informative.items() if keep]
        return (select_groups(rollout, kept) if kept else None), len(informative) - len(kept)


def _varies(values: list[float]) -> bool:
    present = [value for value in values if not np.isnan(value)]
    return len(present) > 1 and float(np.std(present)) > 0


def group_uids(rollout: RolloutBatch) -> list[str]:
    """The batch's groups (``uid``), in order."""
    return list(dict.fromkeys(rollout.non_tensor_batch["uid"]))


def select_groups(rollout: RolloutBatch, uids: Collection[str]) -> RolloutBatch:
    """The rows of the groups ``uids`` (all their trajectories and segments), in batch order."""
    wanted = set(uids)
    rows = np.asarray([uid in wanted for uid in rollout.non_tensor_batch["uid"]], dtype=bool)
    return RolloutBatch(
        rollout.batch[torch.from_numpy(rows)],
        {key: column[rows] for key, column in rollout.non_tensor_batch.items()},
        dict(rollout.meta_info),
    )


def trainable_groups(rollout: RolloutBatch, most: int, ranks: int) -> tuple[RolloutBatch | None, int]:
    """The first groups of ``rollout``, at most ``most`` and as many as split evenly over the FSDP ``ranks`` (each gets
    as many trajectories); None when no count does. Returns them and how many groups were left out."""
    uids = group_uids(rollout)
    per_group = rollout.num_trajectories // len(uids)  # rollout.n: every group has as many trajectories
    count = min(most, len(uids))
    while count and count * per_group % ranks:
        count -= 1
    if count == len(uids):
        return rollout, 0
    return (select_groups(rollout, uids[:count]) if count else None), len(uids) - count
