"""User context strategies for the tests (``multi_turn.context.strategy=tests.support.contexts.<name>``)."""

from __future__ import annotations

from typing import Any

from agentloop.agent_loop.context import sliding_window


def window_failing_on_loop(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sliding window of one turn, but raises for the conversation of script ``loop``: one sample's fault."""
    if any(message["content"] == "script loop" for message in messages):
        raise RuntimeError("cannot rewrite this conversation")
    return sliding_window(messages, 1)


def returns_text(messages: list[dict[str, Any]]) -> Any:
    return "not a message list"


def long_note(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every context gets a note of a few thousand tokens in front: no context fits ``max_model_len``."""
    return [{"role": "system", "content": "note " * 2000}, *messages]


def last_message_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt's first message and the newest observation: a new context every turn."""
    return [messages[0], messages[-1]]
