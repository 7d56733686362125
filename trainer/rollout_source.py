"""Where a training step's rollout comes from, chosen once per run (``rollout_source``): ``SynchronousRollouts``
generates each step's batch when the step asks for it, with the policy about to train; ``StreamedRollouts`` (an async
run, ``async_training.max_staleness > 0``) takes the groups a ``GroupStream`` finished ahead of training. Either way a
source also pushes the new weights to the servers between steps and says where the data continues."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from agentloop import AgentLoopManager
from agentloop.batch import RolloutBatch
from trainer.async_training import AsyncSettings
from trainer.data import BatchSampler
from trainer.dynamic_sampling import GroupFilter, group_uids, trainable_groups

# what pushes the weights of policy version ``step`` to every server
PushWeights = Callable[[int], object]


@dataclass(frozen=True)
class StepShape:
    """What every step's rollout holds: ``groups`` GRPO groups (``data.train_batch_size``, one per row), split over
    ``world_size`` ranks, within ``generate_timeout_s`` (``rollout.generate_timeout_s``)."""

    groups: int
    world_size: int
    generate_timeout_s: float


class RolloutSource(Protocol):
    """A run's rollouts: one batch per step, and the weight push between steps."""

    def next(self, step: int) -> tuple[RolloutBatch | None, float, dict[str, float]]:
        """The rollout to train step ``step`` on (None: dynamic sampling left no group), the seconds the ranks waited
        for it and its sampling metrics."""
        ...

    def push(self, step: int, push_weights: PushWeights, waited_s: float) -> tuple[float, float]:
        """Push version ``step``; the push's seconds and ``waited_s`` plus the ranks' wait for the servers."""
        ...

    def data_state(self) -> dict[str, Any]:
        """Where the data continues (a checkpoint's): past the batches handed out, with those not trained yet."""
        ...

    def stop(self) -> None:
        """Stop generating (the run ends)."""
        ...


class SynchronousRollouts:
    """Each step's rollout generated when the step asks for it, by the policy about to train; with dynamic sampling
    (``group_filter``), as many generation batches as it takes. The servers sleep while the ranks train
    (``rollout.free_cache_engine``)."""

    def __init__(
        self,
        steps: StepShape,
        manager: AgentLoopManager,
        rows: list[dict[str, Any]],
        sampler: BatchSampler,
        batches: Iterator[list[int]],
        group_filter: GroupFilter | None,
        free_cache_engine: bool,
    ) -> None:
        self.steps, self.manager, self.rows, self.sampler, self.batches = steps, manager, rows, sampler, batches
        self.group_filter, self.free_cache_engine = group_filter, free_cache_engine
        self.handed_out = 0  # batches the sampler handed out since the fit (or resume) began

    def next(self, step: int) -> tuple[RolloutBatch | None, float, dict[str, float]]:
        start = time.perf_counter()
        if self.group_filter is None:
            rollout, sampling = self.manager.generate_sequences(self._draw()), {}
        else:
            rollout, sampling = self._sample_dynamically(step)
        waited_s = time.perf_counter() - start
        if self.free_cache_engine:
            self.manager.sleep()
        return rollout, waited_s, sampling

    def push(self, step: int, push_weights: PushWeights, waited_s: float) -> tuple[float, float]:
        start = time.perf_counter()
        push_weights(step)
        push_s = time.perf_counter() - start
        if self.free_cache_engine:
            self.manager.wake_up()
        return push_s, waited_s

    def data_state(self) -> dict[str, Any]:
        return self.sampler.state(self.handed_out)

    def stop(self) -> None:
        pass  # nothing runs between steps

    def _draw(self) -> list[dict[str, Any]]:
        """The rows of the sampler's next batch (counted: the checkpoint's data state continues after it)."""
        self.handed_out += 1
        return [self.rows[index] for index in next(self.batches)]

    def _sample_dynamically(self, step: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Dynamic sampling, synchronously: generation batches, each without its groups whose metric does not vary,
        until they hold ``data.train_batch_size`` groups (the first that many are kept, as verl does) or
        ``max_num_gen_batches`` were made (then the groups there are: as many as split over the ranks); None when no
        group is left to train."""
        wanted, limit = self.steps.groups, self.group_filter.max_num_gen_batches
        kept: list[RolloutBatch] = []
        groups = made = dropped = 0
        while groups < wanted:
            if 0 < limit <= made:
                warnings.warn(
                    f"step {step}: after {made} generation batches (algorithm.filter_groups.max_num_gen_batches={limit}), "
                    f"{groups} of the {wanted} groups a batch holds have a {self.group_filter.metric} that varies: training on those",
                    stacklevel=2,
                )
                break
            informative, groups_dropped = self.group_filter.keep(self.manager.generate_sequences(self._draw()))
            made, dropped = made + 1, dropped + groups_dropped
            if informative is not None:
                kept.append(informative)
                groups += len(group_uids(informative))
        rollout, surplus = (
            trainable_groups(RolloutBatch.concat(kept), wanted, self.steps.world_size) if kept else (None, 0)
        )
        return rollout, {
            "dynamic_sampling/generation_batches": made,
            "dynamic_sampling/dropped_groups": dropped,
            "dynamic_sampling/surplus_groups": surplus,  # groups with a signal beyond the batch (or the ranks' split)
            "dynamic_sampling/kept_groups": len(group_uids(rollout)) if rollout is not None else 0,
        }


class StreamedRollouts:
    """An async run's rollouts: the groups the manager's ``GroupStream`` finished ahead of training, none older than
    the staleness bound (with dynamic sampling, none whose metric does not vary). Weights are pushed while it runs:
    interrupting the requests in flight (partial rollouts), or once none is in flight."""

    def __init__(
        self,
        steps: StepShape,
        manager: AgentLoopManager,
        rows: list[dict[str, Any]],
        sampler: BatchSampler,
        batches: Iterator[list[int]],
        group_filter: GroupFilter | None,
        settings: AsyncSettings,
        version: int,
    ) -> None:
        self.steps, self.rows, self.sampler, self.group_filter = steps, rows, sampler, group_filter
        self.max_staleness, self.partial_rollout = settings.max_staleness, settings.partial_rollout
        self.timeout_s = steps.generate_timeout_s
        max_staleness, groups = settings.max_staleness, steps.groups
        buffer = int(settings.buffer_groups or (1 + max_staleness) * groups)
        keep, max_dropped = None, 0
        if group_filter is not None:  # groups dropped as they finish, up to max_num_gen_batches batches' worth a step
            keep, max_dropped = group_filter.keeps, max(0, group_filter.max_num_gen_batches) * groups
        self.stream = manager.stream(
            ([rows[i] for i in indices] for indices in batches),
            groups,
            max_staleness,
            buffer,
            version=version,
            keep=keep,
            max_dropped=max_dropped,
            order=settings.group_order,
        )

    def next(self, step: int) -> tuple[RolloutBatch | None, float, dict[str, float]]:
        start = time.perf_counter()
        rollout = self.stream.take(step - 1 - self.max_staleness, self.timeout_s)
        waited_s, sampling = time.perf_counter() - start, {}
        if self.group_filter is not None:  # a batch short of groups (the drop limit) trains as many as split over ranks
            rollout, surplus = trainable_groups(rollout, self.steps.groups, self.steps.world_size)
            sampling = {
                "dynamic_sampling/surplus_groups": surplus,
                "dynamic_sampling/kept_groups": len(group_uids(rollout)) if rollout is not None else 0,
            }
        return rollout, waited_s, sampling

    def push(self, step: int, push_weights: PushWeights, waited_s: float) -> tuple[float, float]:
        start = time.perf_counter()
        with contextlib.nullcontext() if self.partial_rollout else self.stream.drained(self.timeout_s):
            waited_s += time.perf_counter() - start
            push_weights(step)
        self.stream.set_version(step)
        return time.perf_counter() - start, waited_s

    def data_state(self) -> dict[str, Any]:
        handed_out, rows = self.stream.untrained_rows()
        position = {id(row): index for index, row in enumerate(self.rows)}
        return self.sampler.state(handed_out, [position[id(row)] for row in rows])

    def stop(self) -> None:
        self.stream.stop()
