"""The agent-loop workers of one manager: started, replaced when one dies, handed every replacement server,
and given work.

Work reaches the workers two ways, both here: a batch (``AgentLoopManager.generate_sequences``) is split into
one consecutive chunk per worker (``split``, ``run_chunks``), and the rollout stream starts each GRPO group on
the worker with the fewest groups in flight (``least_busy``). Which *server* a worker's turn goes to is its
router's choice (``agentloop.router``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable

import numpy as np
import ray
from omegaconf import DictConfig
from ray.exceptions import RayActorError

from agentloop.batch import RolloutBatch
from agentloop.router import RouterStats
from agentloop.server_pool import ServerPool
from agentloop.waiting import wait_for
from agentloop.worker import AgentLoopWorker

logger = logging.getLogger(__name__)


class WorkerPool:
    """``rollout.agent.num_workers`` agent-loop workers, each routing to the current servers of ``servers`` (and
    calling the judge's current ones, ``judges``, serving by now, when there is a judge).

    ``handles`` holds the live worker of each slot; ``restarts`` counts the workers replaced so far.
    """

    def __init__(self, config: DictConfig, servers: ServerPool, judges: ServerPool | None = None) -> None:
        self.config = config
        self.rollout = config.actor_rollout_ref.rollout
        self.servers = servers
        self.judges = judges
        self.restarts = 0
        self._lock = threading.RLock()  # the stream's thread and the caller's both replace dead workers
        self.handles = [self._start() for _ in range(int(self.rollout.agent.num_workers))]

    def _start(self) -> ray.actor.ActorHandle:
        judges = (self.judges.servers, self.judges.addresses) if self.judges is not None else None
        return AgentLoopWorker.options(num_cpus=0).remote(self.config, self.servers.servers, judges)

    def wait_until_ready(self, timeout_s: float) -> None:
        """Wait for every worker to start (load its tokenizer)."""
        wait_for([worker.__ray_ready__.remote() for worker in self.handles], timeout_s, "agent loop workers to start")

    def replace(self, index: int, dead: ray.actor.ActorHandle) -> ray.actor.ActorHandle:
        """Worker ``index``'s successor: started now if ``dead`` (the handle that failed) still holds the slot,
        else the one another thread started for it (the stream and a validation rollout may both see it die)."""
        with self._lock:
            if self.handles[index] is dead:
                self.handles[index] = self._start()
                self.restarts += 1
            return self.handles[index]

    def give_server(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Hand the replacement ``server`` of ``rank`` to every worker's router."""
        # a worker that died meanwhile is replaced later, and a successor being started meanwhile reads the new
        # server list (the lock orders the two)
        with self._lock:
            for worker in self.handles:
                worker.replace_server.remote(rank, server)

    def give_judge(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Hand the replacement judge ``server`` of ``rank`` to every worker."""
        address = self.judges.addresses[rank] if self.judges.addresses else None
        with self._lock:
            for worker in self.handles:
                worker.replace_judge.remote(rank, server, address)

    def shutdown(self) -> None:
        for worker in self.handles:
            ray.kill(worker)

    # ------------------------------------------------------------------ handing out work

    def split(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """``samples`` in one consecutive chunk per worker (fewer when there are fewer samples), of sizes that
        differ by one at most: chunk ``i`` runs on worker ``i``."""
        chunks = np.array_split(np.arange(len(samples)), min(len(self.handles), len(samples)))
        return [[samples[i] for i in chunk] for chunk in chunks]

    def run_chunks(
        self, chunks: list[list[dict[str, Any]]], sampling_params: dict[str, Any], agent_loops: dict[str, Any], deadline: float
    ) -> list[tuple[RolloutBatch, RouterStats]]:
        """Each chunk on its worker; a worker that dies has its chunk rerun on a replacement (twice at most)."""
        used: dict[int, ray.actor.ActorHandle] = {}  # the worker each chunk was last sent to

        def submit(index: int) -> ray.ObjectRef:
            used[index] = self.handles[index]
            return used[index].generate_sequences.remote(chunks[index], sampling_params, agent_loops)

        pending = {submit(index): index for index in range(len(chunks))}
        results: dict[int, tuple[RolloutBatch, RouterStats]] = {}
        reruns = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for ref in pending:
                    ray.cancel(ref)
                total = sum(len(chunk) for chunk in chunks)
                raise TimeoutError(
                    f"timed out after {self.rollout.generate_timeout_s}s waiting for {total} trajectories to finish "
                    "(actor_rollout_ref.rollout.generate_timeout_s)"
                )
            index = pending.pop(ready[0])
            try:
                results[index] = ray.get(ready[0])
            except RayActorError as error:
                reruns += 1
                if reruns > 2 * len(chunks):
                    raise
                logger.warning("agent-loop worker %d died (%s); rerunning its %d samples on a replacement", index, error, len(chunks[index]))
                self.replace(index, used[index])
                pending[submit(index)] = index
        return [results[index] for index in range(len(chunks))]

    def least_busy(self, busy: Iterable[int]) -> int:
        """The worker with the fewest entries in ``busy`` (the worker of each group in flight); the first on a tie."""
        counts = [0] * len(self.handles)
        for index in busy:
            counts[index] += 1
        return counts.index(min(counts))
