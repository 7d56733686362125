"""The router: the only way agent loops reach the engines (verl's ``AsyncLLMServerManager``).

A new session goes to the live server with the fewest requests in flight (counted up on dispatch and
down on completion, so the balance tracks real load); a session then stays on its server, kept in an
LRU cache keyed by the trajectory's request id, so its growing prompt hits that server's prefix
cache. Sessions of one GRPO group (``join_group``) share their prompt: a group's new session goes to
the server of its group's first one while that server has at most ``group_affinity_slack`` more
requests in flight than the least-loaded one, so the prompt is prefilled there once and the others
hit its prefix cache. A server that dies is skipped from then on and its sessions are re-homed on the
next call. A request that new weights interrupted (``finish_reason`` ``interrupted``) is continued:
resubmitted with the tokens it has, for the tokens it has left, until it ends; every model token's
policy version is recorded per session and taken per sample (``take_versions``), also when its loop
generates under request ids of its own, as verl's loops do (``running_sample``). The turns that become
ready in one pass of the event loop (a batch's first turns) go to each server in one Ray call
(``RolloutServer.generate_many``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import ray
from cachetools import LRUCache
from ray.exceptions import RayActorError, RayTaskError

from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput, add_version_run, generate_continued

logger = logging.getLogger(__name__)

# The row request id of the sample whose agent loop runs in this asyncio task (``Router.running_sample``; a task
# the loop starts inherits it): its sessions' tokens' versions and its GRPO group, whatever ids the loop uses.
_current_sample: ContextVar[str | None] = ContextVar("agentloop_current_sample", default=None)


@dataclass
class RouterStats:
    """Counters since the last reset: per-server dispatches and the in-flight balance seen at dispatch."""

    requests_per_server: list[int]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    interrupted_requests: int = 0  # turns that new weights interrupted and the router continued
    server_calls: int = 0  # Ray calls that carried them (a burst of turns goes to a server in one)
    # max/mean of in-flight counts sampled at every dispatch made while all live servers were busy
    imbalance_samples: list[float] = field(default_factory=list)

    @classmethod
    def merge(cls, parts: list[RouterStats]) -> RouterStats:
        """The counters of several routers over the same servers (one router per worker), added up."""
        return cls(
            requests_per_server=[sum(counts) for counts in zip(*(part.requests_per_server for part in parts))],
            prompt_tokens=sum(part.prompt_tokens for part in parts),
            cached_tokens=sum(part.cached_tokens for part in parts),
            interrupted_requests=sum(part.interrupted_requests for part in parts),
            server_calls=sum(part.server_calls for part in parts),
            imbalance_samples=[sample for part in parts for sample in part.imbalance_samples],
        )

    @property
    def cached_token_share(self) -> float:
        """Share of prompt tokens the servers took from their prefix caches."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_call(self) -> float:
        """Requests per Ray call to the servers (1.0: every request was a call of its own)."""
        return sum(self.requests_per_server) / self.server_calls if self.server_calls else 0.0

    @property
    def in_flight_imbalance(self) -> float:
        """Mean over busy dispatches of max/mean in-flight requests per server (1.0: perfectly even)."""
        return sum(self.imbalance_samples) / len(self.imbalance_samples) if self.imbalance_samples else 1.0


class Router:
    """Least-in-flight dispatch with sticky sessions over a list of ``RolloutServer`` handles."""

    def __init__(
        self,
        servers: list[ray.actor.ActorHandle],
        *,
        request_timeout_s: float = 600.0,
        max_sessions: int = 100_000,
        group_affinity_slack: int | None = None,
    ) -> None:
        if not servers:
            raise ValueError("Router needs at least one rollout server")
        self.servers = list(servers)
        self.request_timeout_s = request_timeout_s
        self.in_flight = [0] * len(servers)
        self.alive = [True] * len(servers)
        self.sessions: LRUCache[str, int] = LRUCache(maxsize=max_sessions)
        self.group_affinity_slack = group_affinity_slack  # None: no affinity
        self.group_of: LRUCache[str, str] = LRUCache(maxsize=max_sessions)  # request id -> GRPO group
        self.group_server: LRUCache[str, int] = LRUCache(maxsize=max_sessions)  # group -> its first session's server
        # session -> its model tokens' versions as [version, count] runs: one never taken costs a few runs until
        # evicted, not one entry per token; sample -> the sessions it began under ids other than its own, in order
        self.versions: LRUCache[str, list[list[int]]] = LRUCache(maxsize=max_sessions)
        self.sessions_of: LRUCache[str, list[str]] = LRUCache(maxsize=max_sessions)
        self.stats = RouterStats([0] * len(servers))
        # per server: the calls made in this pass of the event loop, sent together at its end (``_call``)
        self._queued: list[list[tuple[tuple[Any, ...], asyncio.Future[TokenOutput]]]] = [[] for _ in servers]
        self._answering: set[asyncio.Task] = set()

    def join_group(self, request_id: str, group: str) -> None:
        """Mark the session ``request_id`` as one of ``group``'s samples (same prompt)."""
        self.group_of[request_id] = group

    @staticmethod
    @contextlib.contextmanager
    def running_sample(request_id: str) -> Iterator[None]:
        """Within it, the running asyncio task (and the tasks it starts) is the agent loop of the sample
        ``request_id``: sessions it begins under other request ids join its GRPO group and count as its own
        for ``take_versions``."""
        token = _current_sample.set(request_id)
        try:
            yield
        finally:
            _current_sample.reset(token)

    def server_for(self, request_id: str) -> int:
        """The server index a session is (or will be) pinned to."""
        index = self.sessions.get(request_id)
        if index is None or not self.alive[index]:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                raise RuntimeError("every rollout server has died; no request can be served")
            index = min(live, key=lambda i: self.in_flight[i])
            group = self.group_of.get(request_id) or self.group_of.get(_current_sample.get())
            if group is not None and self.group_affinity_slack is not None:
                home = self.group_server.get(group)
                if home is not None and self.alive[home] and self.in_flight[home] - self.in_flight[index] <= self.group_affinity_slack:
                    index = home
                else:
                    self.group_server[group] = index
            self.sessions[request_id] = index
        return index

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
    ) -> TokenOutput:
        """Token-in/token-out generation for one turn of the session ``request_id``.

        ``image_data``: every image of the conversation so far, in order, as ``agentloop.images.ProcessedImage``
        (``prompt_ids`` holds their expanded pads); ``video_data`` is verl's argument, not supported.
        """
        if video_data:
            raise ValueError("video_data is not supported: agentloop's engines take images only")
        if image_data and not all(isinstance(image, ProcessedImage) for image in image_data):
            raise ValueError(
                "image_data must hold agentloop.images.ProcessedImage items (agentloop.images.process_images), "
                "with their expanded pads in prompt_ids"
            )
        sample = _current_sample.get()
        if sample not in (None, request_id) and request_id not in self.versions:  # a session the sample begins
            self.sessions_of.setdefault(sample, []).append(request_id)
        runs = self.versions.setdefault(request_id, [])
        output, versions, interruptions = await generate_continued(
            lambda ids, params: self._generate_once(request_id, ids, params, image_data or None), prompt_ids, sampling_params
        )
        for version, count in versions:
            add_version_run(runs, version, count)
        self.stats.interrupted_requests += interruptions
        return output

    def take_versions(self, request_id: str) -> list[int]:
        """The policy version of each token generated for the sample ``request_id`` so far, in order; forgets them.
        Those of its own session if its loop generated under its id; else those of the sessions it began under
        ids of its own (``running_sample``), one after the other in the order they began. Either way the
        sessions it began are forgotten with it."""
        own = self.versions.pop(request_id, None)
        others = [self.versions.pop(session, []) for session in self.sessions_of.pop(request_id, [])]
        runs = own if own is not None else [run for session in others for run in session]
        return [version for version, count in runs for _ in range(count)]

    async def _generate_once(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], images: list[ProcessedImage] | None
    ) -> TokenOutput:
        while True:
            index = self.server_for(request_id)
            self._dispatched(index)
            try:
                answer = self._call(index, (prompt_ids, sampling_params, request_id, images))
                output = await asyncio.wait_for(answer, self.request_timeout_s)
            except RayActorError as error:
                self.alive[index] = False
                logger.warning("rollout server %d died (%s); re-homing session %s", index, error, request_id)
                continue
            except asyncio.CancelledError:  # the loop was cancelled (a stopping stream): free the server too
                self.servers[index].abort.remote(request_id)
                raise
            except asyncio.TimeoutError:
                self.servers[index].abort.remote(request_id)
                raise TimeoutError(
                    f"request {request_id} got no answer from rollout server {index} within "
                    f"{self.request_timeout_s}s (actor_rollout_ref.rollout.request_timeout_s); it was aborted"
                ) from None
            finally:
                self.in_flight[index] -= 1
            self.stats.prompt_tokens += len(prompt_ids)
            self.stats.cached_tokens += output.cached_tokens
            return output

    def _call(self, index: int, request: tuple[Any, ...]) -> asyncio.Future[TokenOutput]:
        """``generate(*request)`` on server ``index``. The calls made in one pass of the event loop go in one Ray
        call (a Ray call costs both processes about a millisecond, so a burst of turns, such as a batch's first
        ones, would queue behind its own calls); each answer comes back as soon as it is ready."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queued[index].append((request, future))
        if len(self._queued[index]) == 1:
            loop.call_soon(self._send, index)
        return future

    def _send(self, index: int) -> None:
        queued, self._queued[index] = self._queued[index], []
        queued = [(request, future) for request, future in queued if not future.done()]  # not those cancelled meanwhile
        if not queued:
            return
        server = self.servers[index]
        self.stats.server_calls += 1
        requests, futures = zip(*queued)
        try:
            if len(queued) == 1:  # alone, a plain call answers sooner than a streamed one
                answering = _answer_one(server.generate.remote(*requests[0]), futures[0])
            else:
                answering = _answer_many(server.generate_many.remote(list(requests)), list(futures))
        except Exception as error:  # Ray refused the call (arguments it cannot store or serialize, a shutdown)
            for future in futures:
                _settle(future, error)
            return
        task = asyncio.ensure_future(answering)
        self._answering.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._answering.discard)
        unsettled = len(futures)

        def settled(_: asyncio.Future[TokenOutput]) -> None:  # all timed out or cancelled: stop waiting on a hung server
            nonlocal unsettled
            unsettled -= 1
            if not unsettled:
                task.cancel()

        for future in futures:
            future.add_done_callback(settled)

    def replace(self, index: int, server: ray.actor.ActorHandle) -> None:
        """A new server for ``index`` (its predecessor died): live again, nothing in flight; its sessions stay pinned."""
        self.servers[index] = server
        self.alive[index] = True
        self.in_flight[index] = 0

    def _dispatched(self, index: int) -> None:
        self.in_flight[index] += 1
        self.stats.requests_per_server[index] += 1
        live = [self.in_flight[i] for i, ok in enumerate(self.alive) if ok]
        if min(live) > 0:
            self.stats.imbalance_samples.append(max(live) * len(live) / sum(live))

    def take_stats(self) -> RouterStats:
        """Return the counters gathered since the last call and start new ones."""
        stats, self.stats = self.stats, RouterStats([0] * len(self.servers))
        return stats


async def _answer_one(answer: ray.ObjectRef, future: asyncio.Future[TokenOutput]) -> None:
    try:
        _settle(future, await answer)
    except Exception as error:  # the request's own error, or its server's death
        _settle(future, error)


async def _answer_many(answers: ray.ObjectRefGenerator, futures: list[asyncio.Future[TokenOutput]]) -> None:
    try:
        async for answer in answers:
            for position, outcome in await answer:
                _settle(futures[position], outcome.as_instanceof_cause() if isinstance(outcome, RayTaskError) else outcome)
    except Exception as error:  # the server died: every request it had not answered fails with that
        for future in futures:
            _settle(future, error)
    for future in futures:  # never left waiting, whatever the server did
        _settle(future, RuntimeError("the rollout server ended a batch of requests without answering this one"))


def _settle(future: asyncio.Future[TokenOutput], outcome: TokenOutput | BaseException) -> None:
    if future.done():  # timed out or cancelled meanwhile
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
