"""One external agent's session at the gateway: its chat calls recorded as one exact-token trajectory.

A call whose messages extend the conversation so far (the previous call's messages, the reply the gateway returned
for it, then new messages) appends only the new messages' tokens, as observation tokens (loss mask 0), right after
the ids sampled for that reply: a reply the client sends back unchanged is never re-tokenized, so extension is judged
on the sampled ids. Any other call (the client rewrote or dropped history, or changed its tools) starts a new
segment whose context is its messages rendered by the chat template (``rewritten_by="client"``).

A call that gets no reply (refused, messages the chat template cannot render, cancelled because the session closed
while it was in flight, failed in the engine) leaves nothing: ``recording_call`` takes back what it recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import orjson
from transformers import PreTrainedTokenizerBase

from agentloop.agent_loop.trajectory import Trajectory
from agentloop.images import ProcessedImage, expand_image_pads, process_images
from agentloop.protocol import EndReason, TokenOutput, ToolCallRecord
from agentloop.router import RunningSample
from agentloop.server.http.chat import split_message_images


@dataclass(frozen=True)
class SessionLimits:
    """What the rollout allows a session whatever its client asks: ``budget`` response tokens per segment
    (``rollout.response_length``), ``prompt_length`` tokens for the first call's messages, ``max_model_len`` for
    any context, at most ``max_tokens_per_call`` tokens per call (None: the budget only), until ``deadline``
    (``time.monotonic()``)."""

    budget: int
    prompt_length: int
    max_model_len: int
    max_tokens_per_call: int | None
    deadline: float


class SessionOver(Exception):
    """A call the session's limits refuse; the session is over, ``end`` says why."""

    def __init__(self, end: EndReason, message: str) -> None:
        super().__init__(message)
        self.end = end


@dataclass
class Session:
    """An open session: its unguessable id and key, the sample it serves (``sample``: the router's running sample,
    re-entered by every call), the rollout's sampling params and limits, and what its calls recorded. With a
    vision-language ``processor``, the image parts of its messages are the policy's images (None: text only)."""

    id: str
    api_key: str
    sample: RunningSample
    sampling_params: dict[str, Any]
    limits: SessionLimits
    tokenizer: PreTrainedTokenizerBase
    template_kwargs: dict[str, Any]
    processor: Any = None
    trajectory: Trajectory | None = None
    # the conversation as the client sees it: its messages and each reply as the gateway returned it
    conversation: list[dict[str, Any]] = field(default_factory=list)
    conversation_keys: list[bytes] = field(default_factory=list)  # each one's ``_key``, worked out once
    end: str | None = None  # set once the session is over: a limit's EndReason, ``timeout``, or the loop's closing
    last_turn_end: EndReason | None = None  # what the last reply forces (``length`` cut, ``aborted``), if anything
    calls: int = 0
    replied_at: float = 0.0  # time.monotonic() of the last reply
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a session's calls are recorded one at a time
    in_flight: set[asyncio.Task] = field(default_factory=set)
    # the Responses route's answers by response id: the conversation each one ended (its instructions aside), which a
    # later call names as its ``previous_response_id``
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # the ``_key`` of each message of the call being recorded (the messages, then their keys): ``enter`` compares
    # them with the conversation's, ``replied`` keeps them for the next call
    _call_keys: tuple[list[dict[str, Any]], list[bytes]] | None = field(default=None, repr=False)

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.limits.deadline

    @contextlib.contextmanager
    def recording_call(self) -> Iterator[None]:
        """The scope of one call, from ``enter`` to ``replied``: when anything in it raises (SessionOver, ValueError,
        the CancelledError of a call in flight when the session closed, an engine's failure), the trajectory is again
        what it was before the call. A trajectory never ends on the observation of a call that got no reply, nor on
        the empty segment of a rewrite that got none, where the sample's reward would have no model token to sit on."""
        trajectory = self.trajectory
        before = trajectory.checkpoint() if trajectory is not None else None
        try:
            yield
        except BaseException:
            if trajectory is None:
                self.trajectory = None  # the first call: the session has recorded nothing yet
            else:
                trajectory.restore(before)
            raise

    def enter(self, messages: list[dict[str, Any]], tools: list[dict] | None, prefill: bool = False) -> list[int]:
        """Record a call's context (its messages as templates take them, and its tools); return the ids the reply is
        generated from. SessionOver when no reply fits in the session's limits; ValueError for messages the chat
        template cannot render, whether they start the conversation or extend it. Called in ``recording_call``.
        A ``prefill`` call (its last message an assistant turn to continue) is rendered whole: the first call, or a
        new segment (a template delta always ends in a generation prompt)."""
        trajectory = self.trajectory
        if trajectory is None:
            ids, shown, images = self._render(messages, tools, prefill)
            if len(ids) > self.limits.prompt_length:
                self._over(
                    "length",
                    f"the first call's messages are {len(ids)} tokens, more than the rollout's "
                    f"prompt_length={self.limits.prompt_length}",
                )
            self.trajectory = Trajectory(
                self.tokenizer,
                shown,
                ids,
                tools,
                self.template_kwargs,
                self.processor,
                images,
                max_model_len=self.limits.max_model_len,
            )
            return ids
        added = None if prefill else self._extension(messages, tools)
        if added is not None:
            self._note_results(added)
            with _template_errors_as_bad_input():  # (the observation's delta is a render of the added messages)
                fitted = trajectory.add_observation_within(added, self.limits.budget)
            if fitted is None:
                self._over(
                    trajectory.overflow,
                    f"the session's token budget is spent: no reply fits after these "
                    f"messages within rollout.response_length={self.limits.budget}",
                )
            return trajectory.ids
        ids, shown, images = self._render(messages, tools, prefill)
        if len(ids) >= self.limits.max_model_len:
            self._over(
                "context_length",
                f"the rewritten conversation is {len(ids)} tokens: no reply fits within "
                f"max_model_len={self.limits.max_model_len}",
            )
        trajectory.start_segment(ids, shown, rewritten_by="client", tools=tools, images=images)
        return ids

    def count(self, messages: list[dict[str, Any]], tools: list[dict] | None, prefill: bool = False) -> int:
        """The tokens of a context of ``messages`` and ``tools`` rendered on their own (recording nothing)."""
        return len(self._render(messages, tools, prefill)[0])

    def replied(
        self,
        messages: list[dict[str, Any]],
        reply: dict[str, Any],
        output: TokenOutput,
        end: EndReason | None,
        prefill: bool = False,
    ) -> None:
        """Note the reply returned for a call on ``messages``: the next call extends the conversation if it starts
        with both (after a ``prefill``, with the prefilled turn and the reply as one assistant message, as a client
        sends it back). A reply the engine aborted ends the session."""
        self.calls += 1
        keys = self._keys(messages)
        if prefill:
            (*messages, opened), keys = messages, keys[:-1]
            reply = {**reply, "content": opened["content"] + (reply.get("content") or "")}
        self.conversation, self.conversation_keys = [*messages, reply], [*keys, _key(reply)]
        self._call_keys = None
        self.last_turn_end = end
        self.replied_at = time.monotonic()
        self.trajectory.turns[-1].calls = [
            ToolCallRecord(call["function"]["name"], call["function"]["arguments"], "")
            for call in reply.get("tool_calls") or []
        ]
        if end == "aborted":
            self.end = "aborted"

    def _note_results(self, added: list[dict[str, Any]]) -> None:
        """The last reply's tool calls get the results the client sent (in order) and the seconds it took for them."""
        results = [message for message in added if message.get("role") == "tool"]
        for call, message in zip(self.trajectory.turns[-1].calls, results):
            call.result, call.latency_s = str(message.get("content") or ""), time.monotonic() - self.replied_at

    def _extension(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]] | None:
        """The messages a call adds to the conversation so far, or None when it does not extend it."""
        known = self.conversation_keys
        if len(messages) <= len(known) or _canonical(tools) != _canonical(self.trajectory.tools):
            return None
        if self._keys(messages)[: len(known)] != known:
            return None
        return messages[len(known) :]

    def _keys(self, messages: list[dict[str, Any]]) -> list[bytes]:
        """The ``_key`` of each of a call's ``messages``, worked out once per call (a JSON dump each: per call, the
        messages sent, not also those recorded)."""
        if self._call_keys is None or self._call_keys[0] is not messages:
            self._call_keys = (messages, [_key(message) for message in messages])
        return self._call_keys[1]

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, prefill: bool = False
    ) -> tuple[list[int], list[dict[str, Any]], list[ProcessedImage]]:
        """The ids of a context of ``messages``, the messages as the template took them and the images they show:
        with a vision-language processor, each image part a bare ``{"type": "image"}`` part, its image processed
        and its pad widened to the image's tokens (ValueError for an image that cannot be read). ``prefill``: the
        last (assistant) message left open for the reply to continue, instead of a generation prompt."""
        images: list[ProcessedImage] = []
        if self.processor is not None:
            messages, pictures = split_message_images(messages)
            images = process_images(self.processor, pictures, "the call's messages")
        with _template_errors_as_bad_input():
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=not prefill,
                continue_final_message=prefill,
                tokenize=True,
                return_dict=False,
                **self.template_kwargs,
            )
        if images:
            pad = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)
            ids = expand_image_pads(list(ids), images, pad, "the call's messages")
        return list(ids), messages, images

    def _over(self, end: EndReason, message: str) -> None:
        self.end = end
        raise SessionOver(end, message)


@contextlib.contextmanager
def _template_errors_as_bad_input() -> Iterator[None]:
    """The chat template's errors on a client's messages are the client's input: a ValueError (400). Its own checks
    (jinja's raise_exception, bad tool schemas) and fields it needs that a message lacks (the content of a message
    sent with null content: jinja's UndefinedError)."""
    try:
        yield
    except Exception as error:
        raise ValueError(f"the chat template cannot render these messages: {type(error).__name__}: {error}") from error


def _key(message: dict[str, Any]) -> bytes:
    """What must be equal for a message the client sends back to be one the conversation holds. An assistant message
    is the reply the gateway returned when its text and tool calls (name, arguments) are: clients drop or rename
    the rest (call ids, ``reasoning_content``, null vs empty content)."""
    if message.get("role") != "assistant":
        return _canonical(message)
    calls = [
        ((call.get("function") or {}).get("name"), (call.get("function") or {}).get("arguments"))
        for call in message.get("tool_calls") or []
        if isinstance(call, dict)
    ]
    return _canonical(["assistant", message.get("content") or "", calls])


def _canonical(value: Any) -> bytes:
    """A JSON value's canonical dump (keys sorted): equal for equal values, different for different ones. By orjson
    (the standard library's dumps took a twentieth of a gateway call's CPU at 64 sessions), which writes NaN and
    infinities as ``null``: a dump holding ``null`` (or one orjson refuses: an int past 64 bits, a key not a string)
    is the standard library's instead, whose separators no orjson dump has, so that two dumps are equal only when
    their values are."""
    try:
        dump = orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # (orjson.JSONEncodeError is one)
        dump = b"null"
    if b"null" not in dump:
        return dump
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()
