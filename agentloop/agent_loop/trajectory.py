"""Exact-token record of a multi-turn rollout, shared by the multi-turn agent loops.

Model tokens are appended exactly as the engine returned them, with their logprobs, never decoded
and re-encoded. Observations (tool results, user turns) are tokenized as a *delta*: a fixed base
conversation is rendered with and without the new messages and only the suffix is kept, so the
system/tools preamble is never repeated and templates that rewrite earlier turns (``<think>``
stripping) cannot shift tokens already in the trajectory.

With a context strategy other than ``append`` (``agentloop.agent_loop.context``), each observation is followed by
a re-render of the conversation the strategy keeps. A render that extends the current context exactly is appended
like an observation; any other starts a new segment (``Segment``): the exact context the next turn is sampled
under, its images exactly those the context shows.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import logging
import re
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from agentloop.images import ProcessedImage, expand_image_pads, image_inputs, process_images, split_images
from agentloop.agent_loop.context import ContextStrategy
from agentloop.policy_versions import UNKNOWN
from agentloop.protocol import AgentLoopOutput, EndReason, FinishReason, Segment, TokenOutput, TurnRecord

logger = logging.getLogger(__name__)

_BASE = [{"role": "user", "content": "base"}, {"role": "assistant", "content": "base"}]
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
SANITY_CHECK_MODES = ("strict", "ignore_strippable", "disable")


def end_after(finish_reason: FinishReason) -> EndReason | None:
    """The end a model turn forces on its trajectory: an aborted or length-capped turn ends it, a stop does not."""
    return {"abort": "aborted", "length": "length"}.get(finish_reason)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], **kwargs: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


@functools.lru_cache(maxsize=8)
def _eos_before_base_reply(tokenizer: PreTrainedTokenizerBase, template_kwargs: str) -> int:
    """How many end-of-turn tokens the base conversation has before its assistant reply (``template_kwargs``
    as JSON, so that it can key the cache)."""
    return _render(tokenizer, _BASE[:1], **json.loads(template_kwargs)).count(tokenizer.eos_token_id)


def observation_delta(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Ids that follow a model turn ending in eos when ``messages`` are appended (generation prompt on),
    rendered with ``template_kwargs`` (``data.apply_chat_template_kwargs``, e.g. ``enable_thinking``).

    The delta starts right after the base reply's eos *inside the same render*, so templates that
    render a reply differently when it is the last message (Qwen3 adds an empty think block) still
    give the suffix the full conversation has.
    """
    template_kwargs = template_kwargs or {}
    full = _render(tokenizer, _BASE + list(messages), add_generation_prompt=True, **template_kwargs)
    eos = tokenizer.eos_token_id  # (a property that looks the token up: once, not per token)
    ends = [i for i, token in enumerate(full) if token == eos]
    reply = _eos_before_base_reply(tokenizer, json.dumps(template_kwargs, sort_keys=True))
    if len(ends) <= reply:
        raise ValueError("the chat template does not end assistant turns with the tokenizer's eos token")
    return full[ends[reply] + 1 :]


def state_digest(messages: list[dict[str, Any]]) -> str:
    """A short digest of the messages a model turn answers: the identity of the state it was in (GiGPO's step groups,
    ``TurnRecord.state_key``) when the environment names none."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Observation(NamedTuple):
    """The ids an observation adds (image pads expanded), the images it brings (processed) and its messages
    with those images as bare ``{"type": "image"}`` parts; ``closed``: the segment its re-rendered context closed
    (None: it extended the current one)."""

    ids: list[int]
    images: list[ProcessedImage]
    messages: list[dict[str, Any]]
    closed: tuple[Segment, list[ProcessedImage]] | None = None


class Trajectory:
    """Prompt, exact response tokens with mask, logprobs and policy versions, the chat messages they stand for, and a record of
    each model turn (``turns``) with the observation that answered it (``observation_roles``: who spoke in each).

    With a vision-language ``processor``, ``images`` holds every image of the current context in order (the
    prompt's first), each processed once when it arrived; ``messages`` keep them as ``{"type": "image"}`` parts.

    ``prompt_ids``, ``response_*``, ``images`` and ``rewritten_by`` describe the current segment; ``context`` (default
    ``append``) decides each next context and ``max_model_len`` bounds it. ``messages``, ``turns`` and
    ``observation_roles`` span the whole conversation.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: list[dict],
        prompt_ids: list[int],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any] | None = None,
        processor: Any = None,
        images: list[ProcessedImage] | None = None,
        context: ContextStrategy = ContextStrategy("append"),
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.messages = [dict(message) for message in messages]
        self.tools = tools
        self.processor = processor
        self.images = list(images or [])
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.response_versions: list[int] = []  # each response token's policy version (UNKNOWN on observations)
        self.turns: list[TurnRecord] = []  # one per model turn; the loops add what their turn steps did
        self.observation_roles: list[str] = []  # per observation span, for readers of the trajectory
        self.unanswered: Observation | None = None  # the last observation while no model token follows it
        self.withdrawn: Observation | None = None  # an observation taken back: the model never got to answer it
        self.context = context
        self.max_model_len = max_model_len
        self.rewritten_by: str | None = None  # what made the current segment's context (None: the row's prompt)
        self.closed: list[tuple[Segment, list[ProcessedImage]]] = []  # earlier segments, with their images
        self.overflow: EndReason = "length"  # why the last observation did not fit, when it did not
        # the processed images each message brought, by the message's identity (a rewritten context shows
        # exactly the images of the messages it keeps)
        self._message_images: dict[int, tuple[dict[str, Any], list[ProcessedImage]]] = {}
        self._remember_images(self.messages, self.images)
        self._prompt_state = state_digest(self.messages)  # the state the first turn answers

    @property
    def ids(self) -> list[int]:
        """What the model conditions on next: prompt and everything appended so far."""
        return self.prompt_ids + self.response_ids

    @property
    def num_turns(self) -> int:
        """The prompt, each model turn and each observation, as verl counts turns."""
        return 1 + len(self.turns) + len(self.observation_roles)

    @property
    def final_reply(self) -> str:
        """The text of the model's last turn."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    async def generate_turn(
        self, router: Any, request_id: str, sampling_params: dict[str, Any], budget: int
    ) -> tuple[TokenOutput, str, EndReason | None]:
        """Generate the next model turn within what is left of ``budget`` response tokens (and the params'
        ``max_new_tokens``), and append it.

        Returns the engine's output, the turn's text, and the trajectory's end when this turn forces one
        (``aborted`` or ``length``), else None. A turn aborted before its first token takes back the observation
        it was to answer (``withdrawn``): a trajectory ends on a model token, where its reward sits. The empty turn
        stays on record, as the model turn that was asked for.
        """
        room = min(budget - len(self.response_ids), int(sampling_params.get("max_new_tokens") or budget))
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(self.ids))
        params = {**sampling_params, "max_new_tokens": room}
        output = await router.generate(request_id, self.ids, params, image_data=self.images or None)
        if not output.token_ids and output.finish_reason == "abort" and self.unanswered is not None:
            self._withdraw(self.unanswered)
            self.turns.append(TurnRecord(model_tokens=0))
            return output, "", "aborted"
        return output, self.add_model_turn(output), end_after(output.finish_reason)

    def add_model_turn(self, output: TokenOutput) -> str:
        """Append the engine's tokens exactly, and a record of the turn with the state it answered (the observation
        before it, or the prompt); return the turn's text (without the end-of-turn token)."""
        self.response_ids += output.token_ids
        self.response_mask += [1] * len(output.token_ids)
        self.response_logprobs += output.log_probs
        versions = output.policy_versions
        self.response_versions += versions if versions is not None else [UNKNOWN] * len(output.token_ids)
        if self.unanswered is not None:
            state = state_digest(self.unanswered.messages)
        else:  # the first turn answers the prompt; a turn after a rewritten context (start_segment) is not recorded
            state = None if self.turns else self._prompt_state
        self.turns.append(TurnRecord(model_tokens=len(output.token_ids), state_key=state))
        self.unanswered = None
        ids = output.token_ids
        # its end-of-turn token, or another stop id of the model's (Qwen's <|endoftext|>), is no part of the text
        if ids and (
            ids[-1] == self.tokenizer.eos_token_id
            or (output.finish_reason == "stop" and ids[-1] in self.tokenizer.all_special_ids)
        ):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def observation(self, messages: list[dict[str, Any]]) -> Observation:
        """The delta these messages would add (not appended yet: the caller checks the budget). Images in their
        content parts are processed here, once, and only their pads are expanded: earlier ids never change."""
        messages, processed = self._with_images_processed(messages)
        return Observation(self._appended_ids(messages, processed), processed, messages)

    def _appended_ids(self, messages: list[dict[str, Any]], processed: list[ProcessedImage]) -> list[int]:
        """The ids ``messages`` (bringing the images ``processed``) add after the response so far when appended."""
        ids = observation_delta(self.tokenizer, messages, self.template_kwargs)
        if self.response_mask and self.response_mask[-1] and self.response_ids[-1] != self.tokenizer.eos_token_id:
            # the model's turn stopped on another stop id (a generation-config eos such as Qwen's <|endoftext|>, or
            # a stop_token_ids entry): the template would close it with its end-of-turn token, so the delta does
            ids = [self.tokenizer.eos_token_id, *ids]
        if self.processor is not None:
            ids = expand_image_pads(ids, processed, self._image_pad_id, self._where)
        return ids

    @property
    def _where(self) -> str:
        return f"observation after response token {len(self.response_ids)}"

    def _with_images_processed(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[ProcessedImage]]:
        """The messages with their images as bare ``{"type": "image"}`` parts, and those images processed (once)."""
        images: list[Any] = []
        if self.processor is not None or any(isinstance(message.get("content"), list) for message in messages):
            messages, images = split_images(messages, None, self._where)
        return messages, process_images(self.processor, images, self._where)

    def add_observation_within(self, messages: list[dict[str, Any]], budget: int) -> int | None:
        """Append the messages' delta if a model turn still fits after it in ``budget`` response tokens (of the
        current segment), or, when the context strategy's next context is no extension of the current one, start a
        new segment with it if a model turn fits after it within ``max_model_len``.

        Returns the number of observation tokens added to the response (0: a new segment), or None (nothing added)
        when they do not fit, with the end this forces in ``overflow`` (``length``, or ``context_length`` for a new
        context): a trajectory never ends on an observation and never exceeds its budget.
        """
        if self.context.rewrite is not None:  # (the delta would be thrown away: the render replaces it)
            observation = self._rendered(*self._with_images_processed(messages))
        else:
            observation = self.observation(messages)
        extends = observation.closed is None
        if extends and len(self.response_ids) + len(observation.ids) >= budget:
            self.overflow = "length"
            return None
        if (
            self.max_model_len is not None
            and (len(self.ids) if extends else 0) + len(observation.ids) >= self.max_model_len
        ):
            self.overflow = "context_length"
            return None
        self.add_observation(observation)
        return 0 if observation.closed is not None else len(observation.ids)

    def _rendered(self, messages: list[dict[str, Any]], new_images: list[ProcessedImage]) -> Observation:
        """The observation of ``messages`` (bringing ``new_images``) as the context strategy shows it: the conversation
        it keeps, rendered; the tail of that render when it extends the current context exactly, else the whole render
        as a new segment's context."""
        conversation = self.messages + messages
        self._remember_images(messages, new_images)
        kept = self.context.messages(conversation)
        ids = _render(self.tokenizer, kept, tools=self.tools, add_generation_prompt=True, **self.template_kwargs)
        images = [image for message in kept for image in self._images_of(message)]
        if self.processor is not None:
            ids = expand_image_pads(ids, images, self._image_pad_id, f"the context {self.context.name} rendered")
        current = self.ids
        same_images = len(images) >= len(self.images) and all(a is b for a, b in zip(images, self.images))
        if ids[: len(current)] == current and same_images:
            return Observation(ids[len(current) :], images[len(self.images) :], messages)
        segment = dataclasses.replace(self._segment(), closing_observation_ids=self._appended_ids(messages, new_images))
        return Observation(ids, images, messages, (segment, list(self.images)))

    def _remember_images(self, messages: list[dict[str, Any]], images: list[ProcessedImage]) -> None:
        """Note which of ``images`` (in order) each message's image parts show."""
        remaining = iter(images)
        for message in messages:
            parts = message.get("content") if isinstance(message.get("content"), list) else []
            count = sum(isinstance(part, dict) and part.get("type") == "image" for part in parts)
            if count:  # (the message is kept with them: an id is only unique while its object lives)
                self._message_images[id(message)] = (message, [next(remaining) for _ in range(count)])

    def _images_of(self, message: dict[str, Any]) -> list[ProcessedImage]:
        known, images = self._message_images.get(id(message), (None, []))
        if known is message:
            return images
        parts = message.get("content") if isinstance(message.get("content"), list) else []
        if any(isinstance(part, dict) and part.get("type") == "image" for part in parts):
            raise ValueError(
                f"context strategy {self.context.name!r} returned a new message with an image part: a rewritten "
                "context can show only images of the conversation's own messages (keep those message objects)"
            )
        return []

    def _segment(self) -> Segment:
        """The current segment, as it stands (its images' processor outputs are merged at the end, ``to_output``)."""
        return Segment(
            list(self.prompt_ids),
            list(self.response_ids),
            list(self.response_mask),
            list(self.response_logprobs),
            policy_versions=list(self.response_versions),
            rewritten_by=self.rewritten_by,
        )

    def start_segment(
        self,
        context_ids: list[int],
        messages: list[dict[str, Any]],
        rewritten_by: str,
        tools: list[dict] | None,
        images: list[ProcessedImage] | None = None,
    ) -> None:
        """Close the current segment and start one whose context is ``context_ids`` (``messages`` rendered with
        ``tools``, showing ``images``, processed, in order: their pads already widened in ``context_ids``), for a loop
        whose next context is no extension of the current one.
        A current segment with no response yet is replaced rather than closed: it would train on nothing. What the
        closed segment's turns are answered by (its ``closing_observation_ids``) is the messages after the new
        context's last assistant message (all of them when it has none)."""
        if self.response_ids:
            assistant = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
            answer = messages[assistant[-1] + 1 :] if assistant else messages
            # the images the answer shows are the last of the new context's
            shown = sum(
                isinstance(part, dict) and part.get("type") == "image"
                for message in answer
                if isinstance(message.get("content"), list)
                for part in message["content"]
            )
            answer_images = list(images or [])[len(images or []) - shown :] if shown else []
            closing = self._appended_ids(answer, answer_images) if answer else []
            segment = dataclasses.replace(self._segment(), closing_observation_ids=closing)
            self.closed.append((segment, list(self.images)))
        self.prompt_ids, self.rewritten_by, self.tools = list(context_ids), rewritten_by, tools
        self.images = list(images or [])
        self.response_ids, self.response_mask, self.response_logprobs, self.response_versions = [], [], [], []
        self.messages = [dict(message) for message in messages]
        self._remember_images(self.messages, self.images)
        self.unanswered = None

    def add_observation(self, observation: Observation) -> None:
        """Append an observation's ids (mask 0, logprob 0.0) and images, and the messages they render; the last
        model turn's record counts its tokens. An observation that closed the current segment starts the next one
        with its ids as the context instead."""
        ids = observation.ids
        if observation.closed is not None:
            self.closed.append(observation.closed)
            self.prompt_ids, self.images, self.rewritten_by = list(ids), list(observation.images), self.context.name
            self.response_ids, self.response_mask, self.response_logprobs, self.response_versions = [], [], [], []
        else:
            self.response_ids += ids
            self.response_mask += [0] * len(ids)
            self.response_logprobs += [0.0] * len(ids)
            self.response_versions += [UNKNOWN] * len(ids)
            self.images += observation.images
            if self.turns:
                self.turns[-1].observation_tokens += len(ids)
        self.messages += observation.messages
        self.observation_roles.append(",".join(dict.fromkeys(message["role"] for message in observation.messages)))
        self.unanswered = observation

    def _withdraw(self, observation: Observation) -> None:
        """Undo ``add_observation(observation)``, the last thing appended (reopening the segment it closed)."""
        if observation.closed is not None:
            segment, self.images = self.closed.pop()
            self.prompt_ids, self.rewritten_by = segment.prompt_ids, segment.rewritten_by
            self.response_ids, self.response_mask, self.response_logprobs, self.response_versions = (
                segment.response_ids,
                segment.response_mask,
                segment.response_logprobs,
                segment.policy_versions,
            )
        else:
            end = len(self.response_ids) - len(observation.ids)
            del self.response_ids[end:], self.response_mask[end:], self.response_logprobs[end:]
            del self.response_versions[end:]
            del self.images[len(self.images) - len(observation.images) :]
            if self.turns:
                self.turns[-1].observation_tokens -= len(observation.ids)
        del self.messages[len(self.messages) - len(observation.messages) :]
        self.observation_roles.pop()
        self.unanswered, self.withdrawn = None, observation

    def checkpoint(self) -> dict[str, Any]:
        """Its state now, for ``restore`` to go back to when a step must leave nothing (a gateway call cancelled or
        failed before its reply). Lists and dicts are copied, as they change in place; of the turn records only the
        last one is: a step changes no earlier one (it adds the observation answering the last turn, its calls'
        results, and new turns), and copying every record at every step would cost more as the trajectory grows. That
        one is copied as far as a step changes it (its calls' results, its counts), not deep: ``copy.deepcopy`` costs
        several times as much, once per gateway call."""
        state = {name: value.copy() if isinstance(value, (list, dict)) else value for name, value in vars(self).items()}
        if self.turns:
            last = copy.copy(self.turns[-1])
            last.calls, last.env_retries = [copy.copy(call) for call in last.calls], dict(last.env_retries)
            state["turns"][-1] = last
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Go back to a ``checkpoint`` (once: its state becomes the trajectory's): what was appended since, a segment
        started or closed since, and changes to the last turn's record are gone."""
        vars(self).update(state)

    def sanity_check(self, mode: str) -> int:
        """Compare the incremental ids with one full re-render; return the number of mismatching spans.

        ``strict`` counts every difference, ``ignore_strippable`` ignores differences that vanish once
        whitespace and ``<think>`` blocks are removed, ``disable`` skips the check. Never alters ids. Only ``append``
        contexts are checked: a strategy's contexts are renders already.
        """
        if mode not in SANITY_CHECK_MODES:
            raise ValueError(f"multi_turn.tokenization_sanity_check_mode={mode!r}; choose one of {SANITY_CHECK_MODES}")
        if mode == "disable" or self.context.rewrite is not None:
            return 0
        incremental = self.ids
        full = _render(self.tokenizer, self.messages, tools=self.tools, **self.template_kwargs)
        if self.images:
            full = expand_image_pads(full, self.images, self._image_pad_id, "the trajectory's full re-render")
        full = full[: len(incremental)]
        if incremental == full:
            return 0
        # Diff from the first difference on, letting difflib skip tokens that fill over 1% of the text
        # (autojunk): an exact diff of a long repetitive turn (thousands of one token, as degenerate or
        # hostile models write) took seconds per trajectory, blocking the worker's event loop.
        start = next((i for i, (a, b) in enumerate(zip(incremental, full)) if a != b), len(full))
        matcher = difflib.SequenceMatcher(a=incremental[start:], b=full[start:], autojunk=True)
        spans = [
            (tag, a0 + start, a1 + start, b0 + start, b1 + start)
            for tag, a0, a1, b0, b1 in matcher.get_opcodes()
            if tag != "equal"
        ]
        if mode == "ignore_strippable" and _normalized(self.tokenizer.decode(incremental)) == _normalized(
            self.tokenizer.decode(full)
        ):
            return 0
        tag, a0, a1, b0, b1 = spans[0]
        logger.warning(
            "tokenization mismatch (%d span(s)); first: incremental %r vs full render %r",
            len(spans),
            self.tokenizer.decode(incremental[a0:a1]),
            self.tokenizer.decode(full[b0:b1]),
        )
        return len(spans)

    @property
    def multi_modal_inputs(self) -> dict[str, Any] | None:
        """The processor's outputs for every image so far, merged (None without images)."""
        return image_inputs(self.images) if self.images else None

    @property
    def _image_pad_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.processor.image_token)

    def to_output(self, **fields: Any) -> AgentLoopOutput:
        """The finished trajectory with its ``turns``, ``observation_roles`` and ``num_turns``; ``fields`` set the
        rest of ``AgentLoopOutput`` (``end_reason``, ``reward_parts``, ...). Its images' processor outputs are merged
        here, once (``multi_modal_inputs``)."""
        segments = [
            dataclasses.replace(segment, multi_modal_inputs=image_inputs(images) if images else None)
            for segment, images in self.closed
        ]
        return AgentLoopOutput(
            multi_modal_inputs=self.multi_modal_inputs,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            response_mask=self.response_mask,
            response_logprobs=self.response_logprobs,
            policy_versions=self.response_versions,
            turns=self.turns,
            observation_roles=self.observation_roles,
            segments=segments,
            rewritten_by=self.rewritten_by,
            **{"num_turns": self.num_turns, **fields},
        )


def _normalized(text: str) -> str:
    return "".join(_THINK.sub("", text).split())
