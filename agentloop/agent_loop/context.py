"""Context strategies: what the model sees at each turn of ``tool_agent`` and ``env_agent`` (``multi_turn.context``).

``append`` (the default) extends the last context with each observation's exact tokens. Every other strategy is a
function from the conversation so far (chat messages, the new observation last) to the messages the next turn is
sampled under, which the chat template then renders: ``inference_template`` keeps every message (the template may
still drop earlier reasoning, as Qwen3's does), ``sliding_window`` keeps the prompt and the last ``window_turns``
turns, and a user strategy is named by its dotted path. ``Trajectory`` keeps a rendered context that extends the
last one exactly in the same segment, and starts a new segment otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from hydra.utils import get_method
from omegaconf import DictConfig

Messages = list[dict[str, Any]]
BUILT_IN = ("append", "inference_template", "sliding_window")


@dataclass(frozen=True)
class ContextStrategy:
    """A named rewrite of the conversation into the next turn's messages; ``rewrite`` None: ``append``."""

    name: str
    rewrite: Callable[[Messages], Messages] | None = None

    def messages(self, conversation: Messages) -> Messages:
        """The next turn's messages, checked: a strategy that raises or returns no message list fails the sample with
        an error that names it."""
        try:
            kept = self.rewrite(list(conversation))
        except Exception as error:
            raise ValueError(f"context strategy {self.name!r} raised {type(error).__name__}: {error}") from error
        if (
            not isinstance(kept, list)
            or not kept
            or not all(
                isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message
                for message in kept
            )
        ):
            raise ValueError(
                f"context strategy {self.name!r} returned {kept!r:.200}; it must return a non-empty list of "
                "{role, content} chat messages"
            )
        return kept


def keep_all(conversation: Messages) -> Messages:
    """``inference_template``: the whole conversation, for the chat template to render as it would in production."""
    return conversation


def sliding_window(conversation: Messages, window_turns: int) -> Messages:
    """The prompt (every message before the first assistant turn: system and first user message) and the last
    ``window_turns`` turns, each an assistant message with the observation messages that answered it."""
    first = next((i for i, message in enumerate(conversation) if message["role"] == "assistant"), len(conversation))
    starts = [i for i in range(first, len(conversation)) if conversation[i]["role"] == "assistant"]
    if len(starts) <= window_turns:
        return conversation
    return conversation[:first] + conversation[starts[-window_turns] :]


def context_strategy(multi_turn: DictConfig) -> ContextStrategy:
    """The strategy ``multi_turn`` configures: ``context.strategy`` (``use_inference_chat_template=true``, verl's key,
    means ``inference_template``)."""
    settings = multi_turn.get("context") or {}
    name = str(settings.get("strategy") or "append")
    if multi_turn.get("use_inference_chat_template"):
        if name not in ("append", "inference_template"):
            raise ValueError(
                f"multi_turn.use_inference_chat_template=true and multi_turn.context.strategy={name} contradict each "
                "other: keep one (use_inference_chat_template=true means strategy=inference_template)"
            )
        name = "inference_template"
    if name == "append":
        return ContextStrategy(name)
    if name == "inference_template":
        return ContextStrategy(name, keep_all)
    if name == "sliding_window":
        turns = int(settings.get("window_turns") or 0)
        if turns < 1:
            raise ValueError(
                f"multi_turn.context.window_turns={settings.get('window_turns')!r}: sliding_window keeps at least 1 turn"
            )
        return ContextStrategy(name, functools.partial(sliding_window, window_turns=turns))
    return ContextStrategy(name, _user_strategy(name))


def _user_strategy(path: str) -> Callable[[Messages], Messages]:
    if "." not in path:
        raise ValueError(
            f"multi_turn.context.strategy={path!r} is neither one of {BUILT_IN} nor the dotted path of a function "
            "(module.function) from the message list to the next turn's message list"
        )
    try:
        function = get_method(path)
    except Exception as error:
        raise ValueError(f"multi_turn.context.strategy={path!r} cannot be imported: {error}") from error
    return function


def max_model_len(rollout: DictConfig) -> int:
    """The longest context a turn may be sampled under: ``rollout.max_model_len``, else prompt_length + response_length."""
    return int(rollout.get("max_model_len") or int(rollout.prompt_length) + int(rollout.response_length))
