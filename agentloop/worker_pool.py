"""The agent-loop workers of one manager: started, replaced when one dies, handed every replacement server,
and given work.

A worker is a Ray actor (``rollout.agent.num_workers`` of them), or, with ``num_workers=0``, one ``InDriverWorker``: the
same ``AgentLoopWorker`` on an event-loop thread of this process, which saves starting a process and importing the
stack into it (a manager's start and first rollout took 6.3 CPU-seconds instead of 10.3 on 2 cores) where one event
loop keeps up with the servers (small runs, tests). Either way a call returns a ``concurrent.futures.Future``.

Work reaches the workers two ways, both here: a batch (``AgentLoopManager.generate_sequences``) is split into
one consecutive chunk per worker (``split``, ``run_chunks``), and the rollout stream starts each GRPO group on
the worker with the fewest groups in flight (``least_busy``). Which *server* a worker's turn goes to is its
router's choice (``agentloop.router``).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Iterable, Union

import numpy as np
import ray
from omegaconf import DictConfig
from ray.exceptions import RayActorError

from agentloop.batch import RolloutBatch
from agentloop.cluster import actor_resources
from agentloop.router import RouterStats
from agentloop.server_pool import ServerPool
from agentloop.settings import JudgeSettings, RolloutSettings
from agentloop.worker import AgentLoopWorker

logger = logging.getLogger(__name__)

RemoteAgentLoopWorker = ray.remote(AgentLoopWorker)
STOP_TIMEOUT_S = 10.0
WATCH_S = 2.0  # how often a rollout's wait looks at the servers (``run_chunks``' ``while_waiting``)
WORKER_RESOURCES_KEY = "actor_rollout_ref.rollout.agent.resources_per_worker"


class InDriverWorker:
    """An ``AgentLoopWorker`` on a daemon event-loop thread of this process (``rollout.agent.num_workers=0``).

    ``ready`` completes once the worker is built (its tokenizer loaded). ``submit`` runs one of its methods on the loop
    with deep copies of the arguments, as a Ray call would pickle them: an agent loop that edits its row in place
    cannot reach the caller's rows.
    """

    def __init__(self, *args: Any) -> None:
        """``args``: ``AgentLoopWorker``'s."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-loop-worker", daemon=True)
        self._thread.start()
        self._worker: AgentLoopWorker | None = None
        # copies, as an actor gets them: the worker's own server and judge lists are not the pool's
        self.ready = asyncio.run_coroutine_threadsafe(self._build(*copy.deepcopy(args)), self._loop)

    async def _build(self, *args: Any) -> None:
        # built on the loop's thread: whatever the worker creates belongs to the loop that runs it
        self._worker = AgentLoopWorker(*args)

    def submit(self, method: str, *args: Any) -> Future:
        """``method(*args)`` of the worker on its loop (after ``ready``)."""
        args = copy.deepcopy(args)

        async def call() -> Any:
            await asyncio.wrap_future(self.ready)
            result = getattr(self._worker, method)(*args)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self._loop)

    def stop(self) -> None:
        """Shut the worker down (``AgentLoopWorker.shutdown``), cancel every task on the loop (agent loops, MCP
        sessions, health checks), then stop the loop's thread."""

        async def cancel_all() -> None:
            if self._worker is not None:
                self._worker.shutdown()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(STOP_TIMEOUT_S)
        except Exception as error:  # a task that ignores its cancellation: the daemon thread is left to the process
            logger.warning(
                "the in-driver agent-loop worker did not stop its tasks within %ss: %r", STOP_TIMEOUT_S, error
            )
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()


Worker = Union[ray.actor.ActorHandle, InDriverWorker]


class WorkerPool:
    """``rollout.agent.num_workers`` agent-loop workers (0: one ``InDriverWorker``), each routing to the current servers
    of ``servers`` (and calling the judge's current ones, ``judges``, serving by now, when there is a judge).

    ``handles`` holds the live worker of each slot; ``restarts`` counts the workers replaced so far.
    """

    def __init__(
        self,
        config: DictConfig,
        settings: RolloutSettings,
        judge: JudgeSettings | None,
        servers: ServerPool,
        judges: ServerPool | None = None,
    ) -> None:
        """``config``: the composed config, for the agent loops and reward functions (verl's contract); ``settings``
        and ``judge``: the rollout's and the judge's settings the workers run with."""
        self.config = config
        self.settings, self.judge = settings, judge
        self.servers = servers
        self.judges = judges
        self.restarts = 0
        self._lock = threading.RLock()  # the stream's thread and the caller's both replace dead workers
        count = settings.agent.num_workers  # >= 0: checked with the settings
        self._in_driver = count == 0
        self._refs: dict[Future, ray.ObjectRef] = {}  # an actor call's future -> its ref, to cancel it
        self.handles: list[Worker] = [self._start() for _ in range(max(count, 1))]

    def _start(self) -> Worker:
        judges = self.judges.servers if self.judges is not None else None
        args = (self.config, self.settings, self.judge, self.servers.servers, judges)
        if self._in_driver:
            return InDriverWorker(*args)
        return RemoteAgentLoopWorker.options(
            **actor_resources(self.settings.agent.resources, WORKER_RESOURCES_KEY)
        ).remote(*args)

    def call(self, index: int, method: str, *args: Any) -> Future:
        """``method(*args)`` on worker ``index``'s current worker. A dead actor's future raises ``RayActorError``."""
        return self.call_on(self.handles[index], method, *args)

    def call_on(self, worker: Worker, method: str, *args: Any) -> Future:
        """``method(*args)`` on ``worker``."""
        if isinstance(worker, InDriverWorker):
            return worker.submit(method, *args)
        ref = getattr(worker, method).remote(*args)
        future = ref.future()
        self._refs[future] = ref
        future.add_done_callback(lambda done: self._refs.pop(done, None))
        return future

    def cancel(self, futures: Iterable[Future]) -> None:
        """Cancel calls still running (an actor's task through Ray, an in-driver one on its loop)."""
        for future in futures:
            ref = self._refs.pop(future, None)
            if ref is not None:
                ray.cancel(ref)
            future.cancel()

    def wait(self, futures: list[Future], timeout_s: float, what: str) -> list[Any]:
        """Every call's result, in order, within ``timeout_s`` (else ``TimeoutError`` naming ``what``, the calls
        cancelled); a call's error is raised."""
        _, late = wait(futures, timeout_s)
        if late:
            self.cancel(late)
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        return [future.result() for future in futures]

    def wait_until_ready(self, timeout_s: float) -> None:
        """Wait for every worker to start (load its tokenizer)."""
        ready = [
            worker.ready if isinstance(worker, InDriverWorker) else self.call_on(worker, "__ray_ready__")
            for worker in self.handles
        ]
        self.wait(ready, timeout_s, "agent loop workers to start")

    def replace(self, index: int, dead: Worker) -> Worker:
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
                self.call_on(worker, "replace_server", rank, server)

    def give_judge(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Hand the replacement judge ``server`` of ``rank`` to every worker."""
        with self._lock:
            for worker in self.handles:
                self.call_on(worker, "replace_judge", rank, server)

    def shutdown(self) -> None:
        """Shut every worker down (``AgentLoopWorker.shutdown``; an actor's waited for up to ``STOP_TIMEOUT_S``), then
        stop it."""
        actors = [worker for worker in self.handles if not isinstance(worker, InDriverWorker)]
        wait([self.call_on(worker, "shutdown") for worker in actors], STOP_TIMEOUT_S)
        for worker in self.handles:
            if isinstance(worker, InDriverWorker):
                worker.stop()
            else:
                ray.kill(worker)

    # ------------------------------------------------------------------ handing out work

    def split(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """``samples`` in one consecutive chunk per worker (fewer when there are fewer samples), of sizes that
        differ by one at most: chunk ``i`` runs on worker ``i``."""
        chunks = np.array_split(np.arange(len(samples)), min(len(self.handles), len(samples)))
        return [[samples[i] for i in chunk] for chunk in chunks]

    def run_chunks(
        self,
        chunks: list[list[dict[str, Any]]],
        sampling_params: dict[str, Any],
        agent_loops: dict[str, Any],
        deadline: float,
        while_waiting: Callable[[], Any] | None = None,
    ) -> list[tuple[RolloutBatch, RouterStats]]:
        """Each chunk on its worker; a worker that dies has its chunk rerun on a replacement (twice at most).
        ``while_waiting`` is called every ``WATCH_S`` seconds that no chunk finishes."""
        used: dict[int, Worker] = {}  # the worker each chunk was last sent to

        def submit(index: int) -> Future:
            used[index] = self.handles[index]
            return self.call_on(used[index], "generate_sequences", chunks[index], sampling_params, agent_loops)

        pending = {submit(index): index for index in range(len(chunks))}
        results: dict[int, tuple[RolloutBatch, RouterStats]] = {}
        reruns = 0
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, _ = wait(list(pending), timeout=min(WATCH_S, left), return_when=FIRST_COMPLETED)
            if not ready and time.monotonic() < deadline:
                if while_waiting is not None:
                    while_waiting()
                continue
            if not ready:
                self.cancel(pending)
                total = sum(len(chunk) for chunk in chunks)
                raise TimeoutError(
                    f"timed out after {self.settings.generate_timeout_s:g}s waiting for {total} trajectories to finish "
                    "(actor_rollout_ref.rollout.generate_timeout_s)"
                )
            done = next(iter(ready))
            index = pending.pop(done)
            try:
                results[index] = done.result()
            except RayActorError as error:
                reruns += 1
                if reruns > 2 * len(chunks):
                    raise
                logger.warning(
                    "agent-loop worker %d died (%s); rerunning its %d samples on a replacement",
                    index,
                    error,
                    len(chunks[index]),
                )
                self.replace(index, used[index])
                pending[submit(index)] = index
        return [results[index] for index in range(len(chunks))]

    def least_busy(self, busy: Iterable[int]) -> int:
        """The worker with the fewest entries in ``busy`` (the worker of each group in flight); the first on a tie."""
        counts = [0] * len(self.handles)
        for index in busy:
            counts[index] += 1
        return counts.index(min(counts))
