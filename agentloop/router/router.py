"""The router: the only way agent loops reach the engines (verl's ``AsyncLLMServerManager``).

Its parts, each in its own module: ``placement`` (which server a session's requests go to), ``batching`` (the
turns ready in one pass of the event loop go to a server in one Ray call), ``versions`` (each token's policy
version, taken per sample) and ``stats``. Here they meet in ``generate``, which also keeps a turn going
whatever its server does: a turn that new weights interrupted is resubmitted with the tokens it has
(``agentloop.server.continued``); a server that dies, or stops answering the router's probes for
``health_timeout_s``, is skipped from then on and the turns waiting on it are re-homed and run again
elsewhere; a turn with no answer within ``request_timeout_s`` is aborted and fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import ray
from ray.exceptions import RayActorError

from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput
from agentloop.server.continued import generate_continued
from agentloop.router.batching import CallBatcher, settle
from agentloop.router.placement import Placement, ServerSlot
from agentloop.router.stats import RouterStats
from agentloop.router.versions import VersionBook

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunningSample:
    """The sample whose agent loop runs in this asyncio task (``Router.running_sample``), its GRPO group and the LoRA
    adapter its turns are generated with (None: the policy's first, or only)."""

    request_id: str
    group: str | None
    adapter: str | None = None


REPLACEMENT_POLL_S = 0.5  # how often a turn with every server dead looks for a replacement

# Set by ``Router.running_sample``; a task the loop starts inherits it: the sessions it begins, whatever ids the
# loop uses, are the sample's (their tokens' versions) and join its group.
_running: ContextVar[RunningSample | None] = ContextVar("agentloop_running_sample", default=None)


class ServerHung(Exception):
    """The server a request waits on did not answer a probe within ``health_timeout_s``."""


class Router:
    """Least-in-flight dispatch with sticky sessions over a list of ``RolloutServer`` handles.

    ``health_timeout_s`` (None: off) turns on the probes: while a server has requests in flight, the router asks
    it for its load every ``health_timeout_s / 4`` seconds, and one that gives no answer within
    ``health_timeout_s`` has its waiting turns re-homed (when another server is live to take them).
    ``role`` is what its messages call the servers (``judge server`` for a judge's), ``request_timeout_key`` the key
    that sets ``request_timeout_s``.
    """

    def __init__(
        self,
        servers: list[ray.actor.ActorHandle],
        *,
        request_timeout_s: float = 600.0,
        health_timeout_s: float | None = None,
        max_sessions: int = 100_000,
        group_affinity_slack: int | None = None,
        role: str = "rollout server",
        request_timeout_key: str = "actor_rollout_ref.rollout.request_timeout_s",
    ) -> None:
        if not servers:
            raise ValueError(f"Router needs at least one {role}")
        self.request_timeout_s = request_timeout_s
        self.health_timeout_s = health_timeout_s
        self.role, self.request_timeout_key = role, request_timeout_key
        self.placement = Placement(servers, max_sessions, group_affinity_slack, role)
        self.batcher = CallBatcher()
        self.versions = VersionBook(max_sessions)
        self.stats = RouterStats([0] * len(servers))

    @property
    def servers(self) -> list[ray.actor.ActorHandle]:
        """The current server of each rank."""
        return [slot.handle for slot in self.placement.slots]

    @staticmethod
    @contextlib.contextmanager
    def running_sample(request_id: str, group: str | None = None, adapter: str | None = None) -> Iterator[None]:
        """Within it, the running asyncio task (and the tasks it starts) is the agent loop of the sample
        ``request_id``, one of GRPO ``group``'s (same prompt): the sessions it begins, under its id or ids of its
        own, join that group and count as its own for ``take_versions``, and every turn is generated with the LoRA
        ``adapter`` (``actor_rollout_ref.model.lora_adapters``)."""
        token = _running.set(RunningSample(request_id, group, adapter))
        try:
            yield
        finally:
            _running.reset(token)

    @staticmethod
    def current_sample() -> RunningSample | None:
        """The sample whose agent loop runs in this asyncio task (``running_sample``), if any: what code serving that
        sample from another task (an HTTP gateway) enters ``running_sample`` with."""
        return _running.get()

    def server_of(self, request_id: str) -> int | None:
        """The rank of the server the session ``request_id`` is pinned to (None: it has not generated yet)."""
        return self.placement.rank_of(request_id)

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
        sample = _running.get()
        runs = self.versions.begin(request_id, sample.request_id if sample else None)
        output, versions, interruptions = await generate_continued(
            lambda ids, params: self._generate_once(request_id, ids, params, image_data or None, sample),
            prompt_ids,
            sampling_params,
        )
        runs.extend(versions)
        self.stats.interrupted_requests += interruptions
        return output

    def take_versions(self, request_id: str) -> list[int]:
        """The policy version of each token generated for the sample ``request_id`` so far, in order; forgets them
        (``VersionBook.take``)."""
        return self.versions.take(request_id)

    def replace(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """A new server for ``rank`` (its predecessor died): live, nothing in flight; the rank's sessions stay
        pinned to it. Requests still waiting on the predecessor settle on its old slot."""
        self.placement.replace(rank, server)

    def take_stats(self) -> RouterStats:
        """Return the counters gathered since the last call and start new ones."""
        stats, self.stats = self.stats, RouterStats([0] * len(self.placement.slots))
        stats.server_calls = self.batcher.take_calls()
        stats.unhealthy_ranks = [slot.rank for slot in self.placement.slots if not slot.alive]
        return stats

    async def _generate_once(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        images: list[ProcessedImage] | None,
        sample: RunningSample | None,
    ) -> TokenOutput:
        while True:
            slot = await self._place(request_id, sample.group if sample else None)
            request = (prompt_ids, sampling_params, request_id, images)
            if sample is not None and sample.adapter is not None:
                request += (sample.adapter,)  # (RolloutServer.generate's adapter)
            answer = self._dispatch(slot, request)
            try:
                output = await asyncio.wait_for(answer, self.request_timeout_s)
            except (RayActorError, ServerHung) as error:
                slot.alive = False
                self.stats.rehomed_requests += 1
                if isinstance(error, ServerHung):
                    slot.handle.abort.remote(request_id)  # should it wake up, it must not keep generating
                logger.warning("%s %d failed (%s); re-homing session %s", self.role, slot.rank, error, request_id)
                continue
            except asyncio.CancelledError:  # the loop was cancelled (a stopping stream): free the server too
                slot.handle.abort.remote(request_id)
                raise
            except asyncio.TimeoutError:
                slot.handle.abort.remote(request_id)
                raise TimeoutError(
                    f"request {request_id} got no answer from {self.role} {slot.rank} within "
                    f"{self.request_timeout_s}s ({self.request_timeout_key}); it was aborted"
                ) from None
            finally:
                slot.waiting.discard(answer)
            self.stats.prompt_tokens += len(prompt_ids)
            self.stats.cached_tokens += output.cached_tokens
            return output

    async def _place(self, request_id: str, group: str | None) -> ServerSlot:
        """``Placement.place``, but with every server dead it first waits, up to ``request_timeout_s``, for the
        manager to hand over a replacement (it looks for dead servers while it waits on a rollout): with one
        server, its death costs the turns in flight the replacement's start, not their samples. Polled, as
        ``replace`` may come from another thread (agent loops in the driver's process)."""
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        while not any(slot.alive for slot in self.placement.slots):
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(
                    f"every {self.role} has died and none was replaced within {self.request_timeout_s:g}s "
                    f"({self.request_timeout_key}); no request can be served"
                )
            await asyncio.sleep(REPLACEMENT_POLL_S)
        return self.placement.place(request_id, group)

    def _dispatch(self, slot: ServerSlot, request: tuple[Any, ...]) -> asyncio.Future[TokenOutput]:
        answer = self.batcher.call(slot, request)
        slot.waiting.add(answer)  # in flight on it from now on
        self.stats.requests_per_server[slot.rank] += 1
        if (imbalance := self.placement.imbalance()) is not None:
            self.stats.imbalance_samples.append(imbalance)
        if self.health_timeout_s is not None and slot.watcher is None:
            slot.watcher = asyncio.ensure_future(self._watch(slot))
        return answer

    async def _watch(self, slot: ServerSlot) -> None:
        """Probe ``slot``'s server while turns wait on it, or while it is suspected (hung once, not yet answering
        again, not yet replaced). A hung server's waiting turns fail with ``ServerHung`` (their loops re-home
        them) when another live server can take them; one that answers again is live again."""
        timeout = float(self.health_timeout_s)
        suspected = False
        try:
            while slot in self.placement.slots and (slot.waiting or suspected):
                try:
                    await asyncio.wait_for(slot.handle.in_flight.remote(), timeout)
                except RayActorError:
                    slot.alive = False  # gone for good: its turns fail with the same error and are re-homed
                    return
                except asyncio.TimeoutError:
                    if not any(other.alive for other in self.placement.slots if other is not slot):
                        continue  # nowhere to re-home to: the turns wait on (request_timeout_s bounds them)
                    suspected, slot.alive = True, False
                    hung = ServerHung(
                        f"{self.role} {slot.rank} answered no probe within {timeout:g}s "
                        "(actor_rollout_ref.rollout.supervision.health_timeout_s)"
                    )
                    for answer in list(slot.waiting):
                        settle(answer, hung)
                    continue
                if suspected:
                    logger.warning("%s %d answers again; routing to it again", self.role, slot.rank)
                    suspected, slot.alive = False, True
                await asyncio.sleep(timeout / 4)
        finally:
            slot.watcher = None
