"""Splitting a model turn into its reasoning and its content, as thinking models (Qwen3, DeepSeek-R1) write them.

A turn starts inside the reasoning when the rendered prompt opened it: Qwen3's thinking template ends its
generation prompt in ``<think>\\n``, so the model writes only the closing ``</think>``. Otherwise a
reasoning block is one the model opened itself with ``<think>``. Tool calls are parsed from the content
only: a call the model wrote while reasoning was thought about, not made. The names follow SGLang and
vLLM (``reasoning_content`` in the chat API; their ``qwen3`` reasoning parser reads the same tags).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from transformers import PreTrainedTokenizerBase

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The opening tag and the whitespace after it span a few tokens at most, whether the tokenizer has
# them as special tokens or spells them out; decoding this many covers them without decoding the prompt.
PROMPT_TAIL_TOKENS = 16


class ReasoningSplit(NamedTuple):
    """A model turn's text in two parts: ``reasoning`` (None when there is none) and ``content``."""

    reasoning: str | None
    content: str


def prompt_opens_reasoning(tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int]) -> bool:
    """Whether the rendered prompt ends in an opening think tag, so the next turn starts inside the reasoning."""
    tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    return tail.rstrip().endswith(THINK_OPEN)


def split_reasoning(text: str, *, opened: bool) -> ReasoningSplit:
    """The turn's reasoning and content; ``opened``: the prompt opened the reasoning (``prompt_opens_reasoning``).

    A turn with no closing tag ran out of tokens (or stopped) while reasoning: all of it after the
    opening is reasoning. A turn with no reasoning comes back unchanged as content.
    """
    if opened:
        return _split_at_close("", text)
    before, tag, after = text.partition(THINK_OPEN)
    if not tag:
        return ReasoningSplit(None, text)
    return _split_at_close(before, after)


def _split_at_close(before: str, inside_and_after: str) -> ReasoningSplit:
    """Reasoning up to the first closing tag; content is what came before the reasoning and what follows it."""
    reasoning, closed, after = inside_and_after.partition(THINK_CLOSE)
    # a model may write its own opening tag although the prompt already opened one
    reasoning = reasoning.strip().removeprefix(THINK_OPEN).strip()
    content = before + after.lstrip("\n") if closed else before
    return ReasoningSplit(reasoning or None, content)
