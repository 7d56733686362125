"""The rollout servers, supervised: one per data-parallel rank, replaced when it dies.

A server is dead when its actor is gone or when it does not answer a probe within
``rollout.supervision.health_timeout_s``. The pool then starts a replacement on the same rank (the same
placement-group bundle), loads the latest pushed weights into it (not the initial checkpoint), puts it
to sleep if the others sleep, starts its HTTP front, and hands it to ``on_replaced`` (the manager gives it
to every worker's router). A rank restarted more than ``max_restarts`` times within ``window_s`` is given
up: it stays dead, and every later control call skips it and says why. Weight pushes, sleep, wake and
shutdown never raise because one server died; they fail only when no server is left.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentloop.cluster import check_offered
from agentloop.server.collective import WeightGroup, call_off
from agentloop.server.rollout_server import RolloutServer
from agentloop.settings import ServerSettings
from agentloop.waiting import wait_for

logger = logging.getLogger(__name__)


@dataclass
class ServerEvent:
    """What supervision did to one rank: ``restarted`` (with the seconds until it served again) or ``given_up``."""

    rank: int
    kind: str
    cause: str
    seconds: float = 0.0


class ServerPool:
    """Starts, probes, replaces and controls the rollout servers of one manager."""

    def __init__(
        self,
        settings: ServerSettings,
        on_replaced: Callable[[int, ray.actor.ActorHandle], None],
        server_class: Any = RolloutServer,
    ) -> None:
        self.settings = settings  # its role names the servers in messages, its section where their keys are
        self.server_class = server_class  # RolloutServer, or an actor class with its probes and controls (a judge's)
        self.role = settings.role
        self.on_replaced = on_replaced
        self.supervision = settings.supervision
        self.startup_timeout_s = settings.startup_timeout_s
        size = settings.data_parallel_size
        self.bundle = dict(settings.resources)
        check_offered(self.bundle, f"{settings.section}.resources_per_server")
        self.placement_group = placement_group(
            [dict(self.bundle) for _ in range(size)], strategy=settings.placement_strategy
        )
        wait_for(
            [self.placement_group.ready()],
            self.startup_timeout_s,
            f"resources for {size} {self.role}(s) of {self.bundle} each (cluster has {ray.cluster_resources()}; "
            f"lower {settings.section}.resources_per_server or data_parallel_size)",
        )
        self.servers = [self._spawn(rank) for rank in range(size)]  # loading their engines until ``wait_until_serving``
        self.addresses: list[str] = []
        # the latest push, what a replacement must serve: ("object_store", its ref) | ("disk", its directory) |
        # ("collective", the trainer rank actor that keeps it)
        self.latest: tuple[str, Any] | None = None
        self.version: int | None = None  # its policy version
        self.asleep = False
        self.given_up: dict[int, str] = {}
        self.events: list[ServerEvent] = []
        self._restarts: dict[int, deque[float]] = {rank: deque() for rank in range(size)}

    def wait_until_serving(self) -> None:
        """Wait for the servers started with the pool to load their engines, then start their HTTP fronts."""
        wait_for(
            [server.__ray_ready__.remote() for server in self.servers],
            self.startup_timeout_s,
            f"{self.role}s to load their engines",
        )
        self.addresses = self._start_http(self.servers) if self.settings.http.enable else []

    def _spawn(self, rank: int) -> ray.actor.ActorHandle:
        return self.server_class.options(
            num_cpus=self.bundle.get("CPU", 0),
            num_gpus=self.bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank
            ),
        ).remote(self.settings, rank)

    def _start_http(self, servers: list[ray.actor.ActorHandle]) -> list[str]:
        return wait_for(
            [server.start_http.remote() for server in servers], self.startup_timeout_s, "HTTP servers to start"
        )

    @property
    def live_ranks(self) -> list[int]:
        return [rank for rank in range(len(self.servers)) if rank not in self.given_up]

    # ------------------------------------------------------------------ supervision

    def check(self, unhealthy: Collection[int] = ()) -> list[int]:
        """Probe every live server; replace the dead or unresponsive, and those of ``unhealthy`` (ranks the routers
        found dead or hung during a rollout: probing a hung one again would cost ``health_timeout_s`` more).
        Returns the ranks replaced."""
        known = [rank for rank in self.live_ranks if rank in unhealthy]
        probed = [rank for rank in self.live_ranks if rank not in known]
        results = self._call("in_flight", (), self.supervision.health_timeout_s, replace=False, ranks=probed)
        results.update({rank: RuntimeError("found dead or hung by the routers during the rollout") for rank in known})
        failed = [rank for rank, outcome in results.items() if isinstance(outcome, BaseException)]
        for rank in failed:
            self.replace(rank, f"{type(results[rank]).__name__}: {results[rank]}")
        return failed

    def replace_if_all_dead(self) -> list[int]:
        """During a rollout: when every live server's actor is gone (a probe fails at once), replace them all, so
        the turns the routers hold back for want of any server go on (``Router._place``). One dead among live ones
        is left to the routers, which re-home its sessions, and to ``check`` after the rollout. Returns the ranks
        replaced."""
        # a dead actor's probe fails at once: one that is slow to answer is alive (or hung), which is all it tells
        results = self._call("in_flight", (), 1, replace=False)
        if not results or not all(isinstance(outcome, RayActorError) for outcome in results.values()):
            return []
        for rank, error in results.items():
            self.replace(rank, f"died during a rollout: {type(error).__name__}: {error}")
        return list(results)

    def replace(self, rank: int, cause: str) -> None:
        """Start a new server on ``rank`` with the current weights and state, unless its restart budget is spent."""
        now = time.monotonic()
        recent = self._restarts[rank]
        while recent and now - recent[0] > self.supervision.window_s:
            recent.popleft()
        if len(recent) >= self.supervision.max_restarts:
            self.given_up[rank] = cause
            self.events.append(ServerEvent(rank, "given_up", cause))
            logger.error(
                "%s %d died again (%s) after %d restarts within %ss (actor_rollout_ref.rollout.supervision); no longer restarting it",
                self.role,
                rank,
                cause,
                len(recent),
                self.supervision.window_s,
            )
            if not self.live_ranks:
                raise RuntimeError(f"every {self.role} has died and was given up; the last cause: {cause}")
            return
        recent.append(now)
        logger.warning("%s %d is dead (%s); starting a replacement", self.role, rank, cause)
        ray.kill(self.servers[rank])  # a hung server holds its bundle until it is gone
        server = self._spawn(rank)
        wait_for(
            [server.__ray_ready__.remote()],
            self.startup_timeout_s,
            # a server whose node is lost waits for its bundle to find another node that offers its resources
            f"the replacement of {self.role} {rank} to start (it needs a node with {self.bundle} free; the cluster "
            f"now offers {ray.available_resources()}: a lost node's resources return only with the node)",
        )
        if self.latest is not None:
            self._load_latest(rank, server)
        if self.asleep:
            wait_for([server.sleep.remote()], self.startup_timeout_s, f"the replacement of server {rank} to sleep")
        if self.addresses:
            self.addresses[rank] = self._start_http([server])[0]
        self.servers[rank] = server
        self.on_replaced(rank, server)
        self.events.append(ServerEvent(rank, "restarted", cause, time.monotonic() - now))

    # ------------------------------------------------------------------ control of every server

    def _call(
        self, method: str, args: tuple, timeout_s: float, replace: bool = True, ranks: list[int] | None = None
    ) -> dict[int, Any]:
        """``method(*args)`` on every live server (of ``ranks``); a server that dies or times out is replaced
        (``replace``), which leaves the replacement in the state the call was for. Returns rank -> result or
        exception. A replacing call is watched: a server that stops answering (a hung process) is given up on
        within ``supervision.health_timeout_s``, whatever ``timeout_s`` allows the call itself."""
        refs = {
            rank: getattr(self.servers[rank], method).remote(*args)
            for rank in (self.live_ranks if ranks is None else ranks)
        }
        results = self._watch(method, refs, timeout_s) if replace else self._await(method, refs, timeout_s)
        if replace:
            for rank, outcome in results.items():
                if isinstance(outcome, BaseException):
                    self.replace(rank, f"{method}: {type(outcome).__name__}: {outcome}")
        return results

    def _await(
        self, method: str, refs: dict[int, ray.ObjectRef], timeout_s: float, task_errors: bool = False
    ) -> dict[int, Any]:
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        results: dict[int, Any] = {}
        for rank, ref in refs.items():
            if ref not in ready:
                ray.cancel(ref)
                results[rank] = TimeoutError(f"server {rank} did not answer {method} within {timeout_s:.0f}s")
            else:
                results[rank] = _outcome(ref, task_errors)
        return results

    def _watch(
        self,
        method: str,
        refs: dict[int, ray.ObjectRef],
        timeout_s: float,
        task_errors: bool = False,
        on_lost: Callable[[int, BaseException], None] | None = None,
    ) -> dict[int, Any]:
        """Wait for ``refs`` (``method`` on each rank) up to ``timeout_s``, probing every unfinished server each
        tick: one whose probe goes unanswered for ``health_timeout_s`` is hung (its call is cancelled) while the
        others' calls go on. A slow call on a server that answers is waited for. ``on_lost`` hears at once of each
        server found dead or hung."""
        health_s = self.supervision.health_timeout_s
        tick, deadline = min(1.0, health_s / 4), time.monotonic() + timeout_s
        pending, results = dict(refs), {}
        probes: dict[int, tuple[ray.ObjectRef, float]] = {}  # rank -> its unanswered probe, and when it was sent
        while pending:
            ray.wait(list(pending.values()), num_returns=len(pending), timeout=tick)
            now = time.monotonic()
            for rank, ref in list(pending.items()):
                if ray.wait([ref], timeout=0)[0]:
                    results[rank] = _outcome(pending.pop(rank), task_errors)
                    if on_lost and isinstance(results[rank], RayActorError):
                        on_lost(rank, results[rank])
                    continue
                probe, sent = probes.get(rank, (None, now))
                answered = probe is None or bool(ray.wait([probe], timeout=0)[0])
                if now > deadline or (not answered and now - sent > health_s):
                    ray.cancel(pending.pop(rank))
                    results[rank] = TimeoutError(
                        f"{self.role} {rank} did not answer {method} within {timeout_s:.0f}s"
                        if now > deadline
                        else f"{self.role} {rank} stopped answering during {method}: no answer to a health probe "
                        f"within {health_s:.0f}s ({self.settings.section}.supervision.health_timeout_s)"
                    )
                    if on_lost:
                        on_lost(rank, results[rank])
                elif answered:
                    probes[rank] = (self.servers[rank].in_flight.remote(), now)
        return results

    def update_weights(self, ref: ray.ObjectRef, version: int | None = None) -> None:
        """Load ``ref`` (the pushed weights, policy ``version``) into every server; a replacement started now
        loads it too."""
        self.latest, self.version = ("object_store", ref), version
        self._call("update_weights", (ref, version), self.startup_timeout_s)

    def update_weights_from_disk(self, directory: str, version: int | None = None) -> None:
        """Load the checkpoint in ``directory`` (every server must see it) into every server, as ``version``."""
        self.latest, self.version = ("disk", directory), version
        self._call("update_weights_from_disk", (directory, version), self.startup_timeout_s)

    def update_weights_collective(self, source: ray.actor.ActorHandle, version: int | None = None) -> None:
        """Broadcast the weights ``source`` keeps (trainer rank 0, a ``WeightSource``) to every server over a group
        made for this push. A server that dies or stops answering is replaced and sent them in a group of its own;
        one whose receive failed while another died is sent them again; a failure with no server lost (a bad address,
        a server that never joins) raises, naming the servers and the setting."""
        self.latest, self.version = ("collective", source), version
        self._push_collective(source, self.live_ranks)

    def _push_collective(self, source: ray.actor.ActorHandle, ranks: list[int], retry: bool = True) -> None:
        sync = self.settings.weight_sync
        # the source may still be starting, or finishing a step: bounded like any call to a starting actor
        opened = source.open_weight_group.remote(sync.master_port, sync.timeout_s)
        address, port = wait_for([opened], self.startup_timeout_s, "trainer rank 0 to open the weight group")[0]
        group = WeightGroup(
            sync.master_addr or address,
            port,
            tuple(ranks),
            sync.bucket_bytes,
            sync.timeout_s,
            "nccl" if self.bundle.get("GPU") else "gloo",
            self.settings.section,
            self.role,
            name=f"agentloop-weights-{uuid.uuid4().hex[:8]}",  # a group SGLang failed to destroy never clashes
            wire="tensors" if self.settings.name == "sglang" else "buckets",
            members_per_server=self.settings.sglang.tensor_parallel_size if self.settings.name == "sglang" else 1,
        )
        sent = source.broadcast_weights.remote(group)
        refs = {rank: self.servers[rank].update_weights_collective.remote(group, self.version) for rank in ranks}
        lost: dict[int, BaseException] = {}

        def on_lost(rank: int, error: BaseException) -> None:
            # the others would wait for it until weight_sync_timeout_s: call the push off, and end a stopped
            # member (its connections close, so no send to it blocks); the rest get a group without it below
            lost[rank] = error
            ray.kill(self.servers[rank])
            call_off(group, f"{self.role} {rank} was lost ({type(error).__name__})")

        results = self._watch("update_weights_collective", refs, self.startup_timeout_s, True, on_lost)
        [source_outcome] = self._await("broadcast_weights", {0: sent}, sync.timeout_s + 30, task_errors=True).values()
        failed = {
            rank: error for rank, error in results.items() if isinstance(error, BaseException) and rank not in lost
        }
        if failed and (not lost or not retry):
            errors = [*failed.values(), *([source_outcome] if isinstance(source_outcome, BaseException) else [])]
            raise RuntimeError("the collective weight push failed:\n" + "\n".join(_cause(error) for error in errors))
        if failed:  # their receive broke with the lost server's: a group without it
            self._push_collective(source, sorted(failed), retry=False)
        for rank, error in lost.items():
            self.replace(rank, f"update_weights_collective: {type(error).__name__}: {error}")

    def _load_latest(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Give the replacement ``server`` of ``rank`` the latest push."""
        path, what = self.latest
        if path == "collective":
            self.servers[rank] = server
            self._push_collective(what, [rank], retry=False)
            return
        method = server.update_weights_from_disk if path == "disk" else server.update_weights
        wait_for([method.remote(what, self.version)], self.startup_timeout_s, f"the latest weights on server {rank}")

    def busy_s(self) -> dict[int, float]:
        """Each live server's busy seconds so far (time with a request in its engine); a server that does not
        answer within 10 s is left out (it is replaced at the next ``check``)."""
        return {
            rank: busy
            for rank, busy in self._call("busy_s", (), 10.0, replace=False).items()
            if isinstance(busy, float)
        }

    def idle_share_since(self, busy_before: dict[int, float], start: float) -> float:
        """The servers' mean share of the time since ``start`` (``time.perf_counter``) with nothing to generate,
        from their ``busy_s`` then (``busy_before``) and now."""
        elapsed, busy_after = time.perf_counter() - start, self.busy_s()
        shares = [1 - (busy_after[rank] - busy_before[rank]) / elapsed for rank in busy_after if rank in busy_before]
        return min(1.0, max(0.0, sum(shares) / len(shares))) if shares and elapsed > 0 else 0.0

    def sleep(self) -> None:
        self.asleep = True
        self._call("sleep", (), self.startup_timeout_s)

    def wake_up(self) -> None:
        self.asleep = False
        self._call("wake_up", (), self.startup_timeout_s)

    def node_info(self) -> list[dict[str, Any]]:
        results = self._call("node_info", (), self.startup_timeout_s).values()
        return [result for result in results if not isinstance(result, BaseException)]

    def shutdown(self, graceful: bool = True) -> None:
        """Ask every engine to stop (bounded; not when ``graceful`` is off, e.g. servers that failed to start),
        then kill the actors and release their resources."""
        results = self._call("shutdown", (), self.startup_timeout_s, replace=False) if graceful else {}
        stuck = [rank for rank, outcome in results.items() if isinstance(outcome, BaseException)]
        if stuck:
            logger.warning("%ss %s did not shut down cleanly; killing them", self.role, stuck)
        for server in self.servers:
            ray.kill(server)
        remove_placement_group(self.placement_group)


def _outcome(ref: ray.ObjectRef, task_errors: bool = False) -> Any:
    """A finished call's result, or the error that says its server died (or, with ``task_errors``, any error the
    call raised: otherwise that is raised here)."""
    try:
        return ray.get(ref)
    except (RayActorError, GetTimeoutError) as error:
        return error
    except RayTaskError as error:
        if not task_errors:
            raise
        return error


def _cause(error: BaseException) -> str:
    """The message of the error a remote call raised, without Ray's traceback around it."""
    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    return str(cause).strip()
