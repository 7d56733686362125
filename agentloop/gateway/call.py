"""One model call at the gateway, whichever API it came in (Chat Completions, Anthropic Messages, OpenAI Responses):
each API's route translates its request into a ``ChatCall`` and its answer from the ``Reply``; the session records
them all the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatCall:
    """What a call asks: its conversation as chat templates take it (``role``/``content`` text, assistant
    ``tool_calls`` with arguments as objects, ``tool`` results), the tools offered (OpenAI's function schemas), the
    client's cap on the reply's tokens (it can only lower the rollout's), and whether the reply's tool calls are
    parsed (tools offered, and not refused by the call's tool choice). ``prefill``: the last message is an assistant
    turn that the reply continues (Anthropic's prefill), rendered open, without its end of turn."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    parse_tools: bool
    prefill: bool = False


@dataclass(frozen=True)
class Reply:
    """What a call got: the completion's choice (``completion_choice``: the message split into reasoning, content and
    tool calls, ``finish_reason``, the sampled ``token_ids`` with their logprobs) and the context's token ids."""

    choice: dict[str, Any]
    context: list[int]

    @property
    def message(self) -> dict[str, Any]:
        return self.choice["message"]

    def usage(self) -> tuple[int, int]:
        """(context tokens, reply tokens)."""
        return len(self.context), len(self.choice["token_ids"])
