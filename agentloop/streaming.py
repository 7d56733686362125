"""Streaming rollouts: rows go in, finished GRPO groups come out, with no batch boundary between steps.

A daemon thread keeps the agent-loop workers busy: each group (one row's ``n`` samples, all on one
worker, so its router keeps them on one server) starts as soon as three limits allow it, and is handed
back padded once all of its samples are done, into a bounded buffer that ``take`` empties batch by batch.

- **Staleness.** Group ``i`` of the stream belongs to the stream's step ``i // groups_per_batch``, which
  trains policy version ``version + i // groups_per_batch``; it starts only once the servers hold a
  version at most ``max_staleness`` behind that one (AReaL's rule), so the rollout pauses rather than
  run ever further ahead of a trainer that falls behind.
- **Capacity.** Buffered plus in-flight groups never exceed ``capacity``.
- **Holds.** ``drained()`` starts nothing new and waits for the groups in flight (a weight push that must
  not interrupt any request).
- **Order.** ``order="finished"`` hands groups out as they finish: a batch waits for no straggler, but the
  groups that finish first are the short ones, so each batch over-represents short trajectories and the long
  ones wait (and, past the bound, are regenerated). ``order="submitted"`` hands them out in the order their rows
  came (regenerations keep their place): a batch holds the rows the data gave it, as in synchronous training,
  and waits for its slowest group, while later steps' groups keep generating.

A group may still finish later than its step (a slow tool call while other groups overtake it); one that
``take`` finds older than its ``min_version`` is dropped and its row regenerated, never trained on.

With a ``keep`` check (dynamic sampling: the trainer's ``algorithm.filter_groups``), a finished group it refuses is
dropped at once and gives its place among the steps' groups to a new one, so every batch still holds
``groups_per_batch`` kept groups; once ``max_dropped`` groups were dropped while a batch waits, ``take`` returns the
kept groups it has, if any.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from ray.exceptions import RayActorError

from agentloop.batch import RolloutBatch, object_array
from agentloop.policy_versions import UNKNOWN
from agentloop.router import RouterStats
from agentloop.server_pool import ServerPool
from agentloop.worker_pool import Worker, WorkerPool

logger = logging.getLogger(__name__)

ORDERS = ("finished", "submitted")  # GroupStream's orders (``async_training.group_order``)
POLL_S = 0.5  # how long a worker holds a poll for finished groups
MAX_GROUP_RESTARTS = 2  # a group whose worker dies more often than this is taken to be what kills it

# Rows prepared for the workers: their samples (a row's ``n`` consecutive, sharing a ``uid``), the specs of the
# agent loops they name, and the sampling params.
Prepared = tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]


def oldest_versions(batch: RolloutBatch) -> torch.Tensor:
    """Each sample's oldest policy version: its oldest model token's (``rollout_policy_versions``), or the
    batch's ``policy_version`` stamp where no token's version is known."""
    versions = batch.batch["rollout_policy_versions"]
    known = versions != UNKNOWN
    stamped = torch.tensor([int(version) for version in batch.non_tensor_batch["policy_version"]])
    oldest = versions.masked_fill(~known, torch.iinfo(versions.dtype).max).min(-1).values
    return torch.where(known.any(-1), oldest, stamped)


@dataclass
class Group:
    """One row's samples in flight: where, since which policy version, with what."""

    id: int
    row: dict[str, Any]  # the row as the steps gave it
    samples: list[dict[str, Any]]
    agent_loops: dict[str, Any]
    sampling_params: dict[str, Any]
    worker: int = -1
    version: int = -1
    new: bool = True  # False for a regeneration (it does not count against the staleness gate again)
    restarts: int = 0  # times its worker died under it


class GroupStream:
    """Continuous rollouts over a manager's workers (``AgentLoopManager.stream`` builds one).

    ``steps`` yields one training step's rows at a time, which ``prepare`` turns into samples; ``take`` returns
    the next ``groups_per_batch``-sized batch of finished groups, given its failure check and metrics by
    ``finish_batch(batch, stats, elapsed_s)``; ``set_version`` tells the stream which policy the servers hold.
    A dead worker is replaced through ``workers``, a dead server through ``servers``. ``keep(group_batch)``, when
    given, decides whether a finished group is trained on (see the module docstring; ``max_dropped`` <= 0: no limit).
    ``order`` is ``"finished"`` or ``"submitted"`` (the module docstring's "Order"). The caller hands it checked
    settings (the trainer's ``AsyncSettings``: ``max_staleness`` >= 0, ``capacity`` at least one batch).
    """

    def __init__(
        self,
        workers: WorkerPool,
        servers: ServerPool,
        prepare: Callable[[list[dict[str, Any]]], Prepared],
        finish_batch: Callable[[RolloutBatch, RouterStats, float], RolloutBatch],
        steps: Iterator[list[dict[str, Any]]],
        groups_per_batch: int,
        max_staleness: int,
        capacity: int,
        version: int = 0,
        *,
        keep: Callable[[RolloutBatch], bool] | None = None,
        max_dropped: int = 0,
        order: str = "finished",
    ) -> None:
        self.workers = workers
        self.servers = servers
        self._prepare = prepare
        self._finish_batch = finish_batch
        self.groups_per_batch = groups_per_batch
        self.max_staleness = max_staleness
        self.capacity = capacity
        self._keep = keep
        self.max_dropped = max_dropped
        self.order = order
        self.version = version  # the policy version the servers hold
        self._first_version = version
        self._steps = steps
        self._steps_left = True
        self._queued: deque[Group] = deque()  # groups prepared, not started (regenerations first)
        self._started = 0  # new groups started so far
        self._pulled = 0  # items taken from steps so far
        self._next_id = 0
        self._in_flight: dict[int, Group] = {}
        self._buffer: list[tuple[Group, RolloutBatch]] = []
        self._stats: list[RouterStats] = []
        self._regenerated = 0
        self._finished = 0  # groups finished since the last take (kept or not)
        self._dropped = 0  # of those, the groups keep refused
        self._holds = 0
        self._last_take = time.perf_counter()
        self._error: BaseException | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="group-stream", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's side

    def take(self, min_version: int, timeout_s: float) -> RolloutBatch:
        """The next batch: ``groups_per_batch`` finished groups in the stream's ``order``, none with a token older
        than ``min_version`` (older ones are dropped and regenerated); waits up to ``timeout_s``. Fewer groups (at
        least one) once ``max_dropped`` groups were dropped by ``keep`` meanwhile."""
        self.servers.check()  # a server that died is replaced (its sessions were re-homed already)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"the rollout stream failed: {self._error!r}") from self._error
                self._drop_older_than(min_version)
                if self._takeable() >= self.groups_per_batch:
                    break
                if self._buffer and 0 < self.max_dropped <= self._dropped:
                    logger.warning(
                        "dynamic sampling dropped %d groups while a batch waited, the limit (algorithm.filter_groups."
                        "max_num_gen_batches x data.train_batch_size): training on the %d kept groups there are",
                        self._dropped,
                        len(self._buffer),
                    )
                    break
                if not (self._steps_left or self._queued or self._in_flight):
                    raise RuntimeError(
                        f"the rows ran out: {len(self._buffer)} finished groups left, a batch needs {self.groups_per_batch}"
                    )
                if deadline <= time.monotonic():
                    raise TimeoutError(
                        f"timed out after {timeout_s:.0f}s waiting for {self.groups_per_batch} finished groups ({len(self._buffer)} "
                        f"finished, {self._takeable()} of them next in {self.order} order, {len(self._in_flight)} in flight, "
                        f"{self._dropped} dropped by dynamic sampling; "
                        "actor_rollout_ref.rollout.generate_timeout_s)"
                    )
                self._changed.wait(min(1.0, deadline - time.monotonic()))
                self.servers.replace_if_all_dead()  # (the groups in flight wait for a server)
            taken, self._buffer = self._buffer[: self.groups_per_batch], self._buffer[self.groups_per_batch :]
            stats, self._stats = RouterStats.merge(self._stats) if self._stats else RouterStats([]), []
            regenerated, self._regenerated = self._regenerated, 0
            finished, self._finished, dropped, self._dropped = self._finished, 0, self._dropped, 0
            buffered = len(self._buffer)
            self._changed.notify_all()
        now = time.perf_counter()
        batch = self._finish_batch(
            RolloutBatch.concat([group_batch for _, group_batch in taken]), stats, now - self._last_take
        )
        batch.meta_info.update({"async/regenerated_groups": regenerated, "async/buffered_groups": buffered})
        if self._keep is not None:
            batch.meta_info.update(
                {"dynamic_sampling/finished_groups": finished, "dynamic_sampling/dropped_groups": dropped}
            )
        self._last_take = now
        return batch

    def _takeable(self) -> int:
        """How many groups at the buffer's head a batch may take now: all of them in finish order; in submission
        order those that came before every group still queued or in flight (the buffer is kept sorted by id)."""
        if self.order == "finished":
            return len(self._buffer)
        unfinished = min((group.id for group in (*self._queued, *self._in_flight.values())), default=None)
        return sum(1 for group, _ in self._buffer if unfinished is None or group.id < unfinished)

    def set_version(self, version: int) -> None:
        """The servers now hold policy ``version``: groups of later steps may start."""
        with self._changed:
            self.version = version
            self._changed.notify_all()

    @contextlib.contextmanager
    def drained(self, timeout_s: float) -> Iterator[None]:
        """Start no group and wait (up to ``timeout_s``) until none is in flight, for the ``with`` block."""
        with self._changed:
            self._holds += 1
            try:
                if not self._changed.wait_for(lambda: not self._in_flight or self._error is not None, timeout_s):
                    raise TimeoutError(
                        f"{len(self._in_flight)} groups were still in flight after {timeout_s:.0f}s of waiting to push weights "
                        "without interrupting them (actor_rollout_ref.rollout.generate_timeout_s; or set "
                        "async_training.partial_rollout=true, which interrupts and continues them instead)"
                    )
            except BaseException:
                self._holds -= 1
                raise
        try:
            yield
        finally:
            with self._changed:
                self._holds -= 1
                self._changed.notify_all()

    def untrained_rows(self) -> tuple[int, list[dict[str, Any]]]:
        """How many items of ``steps`` the stream has taken, and those of their rows whose groups no ``take`` has
        returned yet (queued, in flight or buffered), in the order they came: what a checkpoint must replay."""
        with self._changed:
            groups = sorted(
                [*self._queued, *self._in_flight.values(), *(group for group, _ in self._buffer)],
                key=lambda group: group.id,
            )
            return self._pulled, [group.row for group in groups]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Start nothing more and drop the groups in flight (their workers cancel them)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join(timeout_s)
        with contextlib.suppress(Exception):
            calls = [self.workers.call(index, "cancel_groups") for index in range(len(self.workers.handles))]
            self.workers.wait(calls, timeout_s, "the agent-loop workers to cancel their groups")

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        polls: dict[Future, tuple[int, Worker]] = {}  # one poll per worker with groups in flight
        try:
            while not self._stopping:
                self._start_groups()
                busy = {group.worker for group in self._in_flight.values()} - {index for index, _ in polls.values()}
                for index in busy:
                    worker = self.workers.handles[index]
                    polls[self.workers.call_on(worker, "finished_groups", POLL_S)] = (index, worker)
                if not polls:
                    with self._changed:
                        self._changed.wait(0.1)
                    continue
                ready, _ = wait(list(polls), timeout=0.1, return_when=FIRST_COMPLETED)
                for poll in ready:
                    self._receive(poll, *polls.pop(poll))
        except BaseException as error:  # handed to take(), which raises it
            logger.exception("the rollout stream failed")
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _start_groups(self) -> None:
        starting = []
        with self._changed:
            while not self._holds and len(self._buffer) + len(self._in_flight) < self.capacity:
                group = self._next_group()
                if group is None:
                    break
                group.worker = self.workers.least_busy(other.worker for other in self._in_flight.values())
                group.version = self.version
                self._started += group.new
                group.new = False
                self._in_flight[group.id] = group
                starting.append(group)
        for group in starting:
            self.workers.call(
                group.worker, "start_group", group.id, group.samples, group.sampling_params, group.agent_loops
            )

    def _next_group(self) -> Group | None:
        """The next group allowed to start: a regeneration, or a new one the staleness gate admits."""
        if self._queued and not self._queued[0].new:
            return self._queued.popleft()
        step = self._started // self.groups_per_batch  # the stream's step the next new group belongs to
        if self.version < self._first_version + step - self.max_staleness:
            return None
        if not self._queued and self._steps_left:
            rows = next(self._steps, None)
            if rows is None:
                self._steps_left = False
            else:
                samples, agent_loops, params = self._prepare(rows)
                self._pulled += 1  # after prepare: a step whose rows failed there is not checkpointed as taken
                for row, uid in zip(
                    rows, dict.fromkeys(sample["uid"] for sample in samples)
                ):  # a row's samples are consecutive
                    self._queued.append(
                        Group(self._next_id, row, [s for s in samples if s["uid"] == uid], agent_loops, params)
                    )
                    self._next_id += 1
        return self._queued.popleft() if self._queued else None

    def _receive(self, poll: Future, worker: int, handle: Worker) -> None:
        try:
            finished, stats = poll.result()
        except RayActorError as error:
            lost = [group for group in self._in_flight.values() if group.worker == worker]
            logger.warning(
                "agent-loop worker %d died (%s); restarting its %d groups on a replacement", worker, error, len(lost)
            )
            for group in lost:
                group.restarts += 1
                if group.restarts > MAX_GROUP_RESTARTS:
                    raise RuntimeError(
                        f"the agent-loop worker running group {group.id} (rollout stream; row {group.row.get('prompt')!r:.200}) died "
                        f"{group.restarts} times: something in its samples kills the worker process (a tool or reward "
                        f"exhausting memory, a crashing native library); see the worker's log. Last error: {error}"
                    )
            successor = self.workers.replace(worker, handle)
            for group in lost:
                self.workers.call_on(
                    successor, "start_group", group.id, group.samples, group.sampling_params, group.agent_loops
                )
            return
        with self._changed:
            self._stats.append(stats)
            for group_id, result in finished:
                if isinstance(result, Exception):
                    raise result
                group = self._in_flight.pop(group_id)
                result.non_tensor_batch["policy_version"] = object_array([group.version] * len(result))
                self._finished += 1
                if self._keep is not None and not self._keep(result):
                    self._dropped += 1
                    self._started -= 1  # its place among the steps' groups goes to the new group that replaces it
                    continue
                self._buffer.append((group, result))
            if self.order == "submitted":
                self._buffer.sort(key=lambda entry: entry[0].id)
            self._changed.notify_all()

    def _drop_older_than(self, min_version: int) -> None:
        stale = [entry for entry in self._buffer if int(oldest_versions(entry[1]).min()) < min_version]
        for group, _ in stale:
            logger.info(
                "group %d (policy version %d) is older than version %d: regenerating it",
                group.id,
                group.version,
                min_version,
            )
            for sample in group.samples:  # a fresh session per sample: nothing of the stale one is reused
                sample["request_id"] = str(uuid.uuid4())
            self._queued.appendleft(group)
        self._buffer = [entry for entry in self._buffer if all(entry is not old for old in stale)]
        self._regenerated += len(stale)
