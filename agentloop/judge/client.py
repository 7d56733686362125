"""``Judge``: an agent-loop worker's client of the judge servers (``reward_model.*``), for reward functions,
environments and interactions (and, through its HTTP front, ``agentloop.judge.front``, for verl's GenRM functions).

The worker hands its judge to the reward step and, through their loops, to environments and interactions; while a
sample's loop and reward run (``judge_session``, for the sample's asyncio task), every call is recorded for the sample
as a ``JudgeCall`` (what was asked, what came
back, tokens, seconds, the error): the batch carries them (``SampleScore.judge_calls``), the ``judge/*`` metrics
count them and the viewer shows them. A call that times out (``reward_model.timeout_s``), whose server fails, or
whose reply cannot be read (``grade`` with a reader that raises ``JudgeUnparsable``) raises ``JudgeError`` with the
judge's text: the sample fails (``rollout.max_failed_sample_ratio``), never the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import time
import uuid
from typing import Any, Callable, Iterator

import ray
from transformers import AutoTokenizer

from agentloop.judge.front import JudgeFront
from agentloop.judge.session import JudgeCall, JudgeError, JudgeUnparsable, last_call, record, recording
from agentloop.protocol import TokenOutput
from agentloop.router import Router
from agentloop.settings import JudgeSettings


@contextlib.contextmanager
def judge_session(judge: Judge | None, sample: str) -> Iterator[list[JudgeCall]]:
    """Within it, the judge calls of this task are the sample ``sample``'s (and ``judge``'s front's address is the
    sample's); yields the list they are recorded in."""
    with recording() as calls:
        front = judge.front if judge is not None else None
        admitted = front.admitting(sample, calls) if front is not None else contextlib.nullcontext()
        try:
            with admitted:
                yield calls
        finally:
            if judge is not None and judge.router is not None:
                judge.router.take_versions(sample)  # the judge's own sessions are the sample's there: forgotten with it


class Judge:
    """The worker's way to the judge servers: ``chat``/``generate``/``grade`` for a generative judge (through a
    ``Router`` of its own, as the policy's turns go), ``score`` for a discriminative reward model.

    ``router_address()`` is verl's ``reward_router_address`` for the sample being scored (``agentloop.judge.front``).
    """

    def __init__(self, settings: JudgeSettings, servers: list[ray.actor.ActorHandle], tokenizer: Any) -> None:
        self.kind = settings.kind
        self.timeout_s = settings.timeout_s
        self.tokenizer = tokenizer
        self.sampling = dict(settings.sampling)
        self.router = (
            Router(
                servers,
                request_timeout_s=self.timeout_s,
                health_timeout_s=settings.servers.supervision.health_timeout_s,
                role=settings.servers.role,
                request_timeout_key="reward_model.timeout_s",
            )
            if self.kind == "generative"
            else None
        )
        self.scorers = list(servers)  # a reward model's servers (the router holds a judge's)
        self._turn = itertools.count()
        # verl's reward_router_address (a reward model has none: its functions call score())
        self.front = (
            JudgeFront(self, settings.model_path, settings.servers.tool_format) if self.router is not None else None
        )

    @classmethod
    def from_settings(cls, settings: JudgeSettings, servers: list[ray.actor.ActorHandle]) -> Judge:
        """The judge of ``servers``, with its model's tokenizer."""
        return cls(settings, servers, AutoTokenizer.from_pretrained(settings.model_path))

    async def router_address(self) -> str | None:
        """verl's ``reward_router_address`` for the sample being scored: ``host:port/samples/<token>``, whose
        ``/v1/chat/completions`` and ``/generate`` reach this judge as that sample's calls; None for a reward model."""
        return await self.front.address() if self.front is not None else None

    def replace(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Call ``server`` for ``rank`` from now on (the manager replaced a dead one)."""
        if self.router is not None:
            self.router.replace(rank, server)
        self.scorers[rank] = server

    # ------------------------------------------------------------------ generative

    async def generate(self, prompt_ids: list[int], timeout_s: float | None = None, **sampling: Any) -> str:
        """The judge's reply to exact prompt ids, decoded (``sampling`` overrides ``reward_model.rollout``'s, ``timeout_s``
        ``reward_model.timeout_s``)."""
        output = await self.sample(prompt_ids, timeout_s, **sampling)
        return self.tokenizer.decode(output.token_ids, skip_special_tokens=True)

    async def sample(self, prompt_ids: list[int], timeout_s: float | None = None, **sampling: Any) -> TokenOutput:
        """``generate``'s call, its tokens as the engine returned them."""
        if self.router is None:
            raise RuntimeError("this judge is a discriminative reward model (reward_model.kind): call score()")
        start, timeout_s = time.perf_counter(), self.timeout_s if timeout_s is None else timeout_s
        try:
            output = await asyncio.wait_for(
                self.router.generate(f"judge-{uuid.uuid4()}", list(prompt_ids), {**self.sampling, **sampling}),
                timeout_s,
            )
        except asyncio.TimeoutError:
            raise self._failed(
                prompt_ids,
                start,
                JudgeError(f"the judge gave no answer within {timeout_s:g}s (reward_model.timeout_s)"),
            ) from None
        except Exception as error:  # its server failed, or it refused the request (too long a prompt)
            raise self._failed(
                prompt_ids, start, JudgeError(f"the judge call failed: {type(error).__name__}: {error}")
            ) from error
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        record(
            JudgeCall(
                self.tokenizer.decode(prompt_ids),
                text,
                len(prompt_ids),
                len(output.token_ids),
                time.perf_counter() - start,
            )
        )
        return output

    async def chat(self, messages: list[dict[str, Any]], timeout_s: float | None = None, **sampling: Any) -> str:
        """The judge's reply to chat ``messages`` (rendered with its chat template and the generation prompt)."""
        return await self.generate(self._render(messages, add_generation_prompt=True), timeout_s, **sampling)

    async def grade(self, messages: list[dict[str, Any]], read: Callable[[str], float], **sampling: Any) -> float:
        """``read(reply)`` of the judge's reply to ``messages``; a reader that raises ``JudgeUnparsable`` (or any
        error) fails the call, which is recorded with the reply."""
        text = await self.chat(messages, **sampling)
        try:
            grade = read(text)
            return float(await grade if inspect.isawaitable(grade) else grade)
        except Exception as error:
            failure = (
                error if isinstance(error, JudgeError) else JudgeUnparsable(text, f"{type(error).__name__}: {error}")
            )
            call = last_call()
            if call is not None:
                call.error = str(failure)
            raise failure from None

    # ------------------------------------------------------------------ discriminative

    async def score(self, messages: list[dict[str, Any]]) -> float:
        """The reward model's score of the conversation ``messages`` (its chat template, no generation prompt)."""
        if self.router is not None:
            raise RuntimeError("this judge is generative (reward_model.kind): call chat(), generate() or grade()")
        ids = self._render(messages, add_generation_prompt=False)
        start = time.perf_counter()
        server = self.scorers[next(self._turn) % len(self.scorers)]
        try:
            value = float(await asyncio.wait_for(server.score.remote(ids), self.timeout_s))
        except asyncio.TimeoutError:
            raise self._failed(
                ids,
                start,
                JudgeError(f"the reward model gave no score within reward_model.timeout_s={self.timeout_s:g}s"),
            ) from None
        except Exception as error:
            raise self._failed(
                ids, start, JudgeError(f"the reward model failed: {type(error).__name__}: {error}")
            ) from error
        record(JudgeCall(self.tokenizer.decode(ids), repr(value), len(ids), 0, time.perf_counter() - start))
        return value

    # ------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )

    def _failed(self, prompt_ids: list[int], start: float, error: JudgeError) -> JudgeError:
        record(
            JudgeCall(
                self.tokenizer.decode(prompt_ids),
                error.text,
                len(prompt_ids),
                0,
                time.perf_counter() - start,
                str(error),
            )
        )
        return error
