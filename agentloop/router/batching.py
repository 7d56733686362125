"""Calls to the rollout servers, batched: the turns that become ready in one pass of the event loop (a batch's
first turns) go to their server in one Ray call (``RolloutServer.generate_many``). A Ray call costs both
processes about a millisecond, so a burst of turns would otherwise queue behind its own calls; each answer
still comes back as soon as it is ready."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.exceptions import RayTaskError

from agentloop.protocol import TokenOutput
from agentloop.router.placement import ServerSlot


class CallBatcher:
    """``generate(*request)`` on a server slot, one Ray call per slot and pass of the event loop."""

    def __init__(self) -> None:
        self.calls = 0  # Ray calls made (``take_calls``)
        self._queued: dict[ServerSlot, list[tuple[tuple[Any, ...], asyncio.Future[TokenOutput]]]] = {}
        self._answering: set[asyncio.Task] = set()

    def call(self, slot: ServerSlot, request: tuple[Any, ...]) -> asyncio.Future[TokenOutput]:
        """The answer of ``generate(*request)`` on ``slot``'s server, sent with the others queued in this pass."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        queued = self._queued.setdefault(slot, [])
        queued.append((request, future))
        if len(queued) == 1:
            loop.call_soon(self._send, slot)
        return future

    def take_calls(self) -> int:
        """The Ray calls made since the last call."""
        calls, self.calls = self.calls, 0
        return calls

    def _send(self, slot: ServerSlot) -> None:
        queued = [
            (request, future) for request, future in self._queued.pop(slot, []) if not future.done()
        ]  # not those cancelled meanwhile
        if not queued:
            return
        self.calls += 1
        requests, futures = zip(*queued)
        try:
            if len(queued) == 1:  # alone, a plain call answers sooner than a streamed one
                answering = _answer_one(slot.handle.generate.remote(*requests[0]), futures[0])
            else:
                answering = _answer_many(slot.handle.generate_many.remote(list(requests)), list(futures))
        except Exception as error:  # Ray refused the call (arguments it cannot store or serialize, a shutdown)
            for future in futures:
                settle(future, error)
            return
        task = asyncio.ensure_future(answering)
        self._answering.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._answering.discard)
        unsettled = len(futures)

        def settled(
            _: asyncio.Future[TokenOutput],
        ) -> None:  # all timed out or cancelled: stop waiting on a hung server
            nonlocal unsettled
            unsettled -= 1
            if not unsettled:
                task.cancel()

        for future in futures:
            future.add_done_callback(settled)


async def _answer_one(answer: ray.ObjectRef, future: asyncio.Future[TokenOutput]) -> None:
    try:
        settle(future, await answer)
    except Exception as error:  # the request's own error, or its server's death
        settle(future, error)


async def _answer_many(answers: ray.ObjectRefGenerator, futures: list[asyncio.Future[TokenOutput]]) -> None:
    try:
        async for answer in answers:
            for position, outcome in await answer:
                settle(
                    futures[position], outcome.as_instanceof_cause() if isinstance(outcome, RayTaskError) else outcome
                )
    except Exception as error:  # the server died: every request it had not answered fails with that
        for future in futures:
            settle(future, error)
    for future in futures:  # never left waiting, whatever the server did
        settle(future, RuntimeError("its server ended a batch of requests without answering this one"))


def settle(future: asyncio.Future[TokenOutput], outcome: TokenOutput | BaseException) -> None:
    """Give ``future`` its outcome unless it already has one (timed out or cancelled meanwhile)."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
