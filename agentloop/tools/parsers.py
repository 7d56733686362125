"""Tool-call parsers, chosen by ``multi_turn.format``. New formats register with ``@register_parser``.

A parser turns a model turn's text into ``(content, calls)``; a text with no call (nor reasoning) is its own
content, unchanged.
Reasoning inside ``<think>…</think>`` (or after an unclosed ``<think>``) is never parsed: a call the model only
thought about is not made.
Reasoning the prompt opened has no ``<think>`` in the turn's text: callers pass only the content that
``agentloop.tools.reasoning.split_reasoning`` leaves.
"""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any, Callable

from agentloop.tools.schemas import ToolCall

Parser = Callable[[str], tuple[str, list[ToolCall]]]
_PARSERS: dict[str, Parser] = {}

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
# Real arguments nest a few levels. Deeper JSON is rejected as unparsable: it would otherwise reach
# Python's recursion limit later, where no one catches it (repr in error texts, jsonschema, pickling
# the trajectory to the trainer, the JSON of rollout dumps).
MAX_JSON_DEPTH = 100
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff, of which a lone one is not text


def register_parser(name: str) -> Callable[[Parser], Parser]:
    """Register a function ``text -> (content, calls)`` as the parser for ``multi_turn.format=name``."""

    def decorator(function: Parser) -> Parser:
        _PARSERS[name] = function
        return function

    return decorator


def get_parser(name: str) -> Parser:
    if name not in _PARSERS:
        raise KeyError(f"unknown multi_turn.format {name!r}; registered tool-call parsers: {sorted(_PARSERS)}")
    return _PARSERS[name]


def strip_thinking(text: str) -> str:
    return _THINK.sub("", text)


def load_json(text: str) -> Any:
    """``json.loads`` for model-written JSON: every way it can fail is a ``ValueError``.

    ``json.loads`` raises ``RecursionError`` on deeply nested input (10,000 ``[``) and a plain
    ``ValueError`` on integers of more than 4300 digits; neither is a ``JSONDecodeError``.
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to decode") from None
    if _nested_deeper_than(value, MAX_JSON_DEPTH):
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(text):
        # A lone "\ud800" escape decodes to a lone surrogate, which no UTF-8 encoder takes: it would
        # raise later in a tokenizer, a rollout dump or an HTTP response. Replaced here, once.
        value = json.loads(valid_utf8(json.dumps(value, ensure_ascii=False)))
    return value


def valid_utf8(text: str) -> str:
    """The text with lone surrogates replaced by "?" (tokenizers and UTF-8 writers reject them)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether lists/objects nest more than ``limit`` levels; iterative, so any depth is safe to measure."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _json_error(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at position {error.pos}"
    return str(error)[:200]  # Python's own messages, e.g. the 4300-digit limit on integers


def _split_calls(text: str, parse_body: Callable[[str], ToolCall]) -> tuple[str, list[ToolCall]]:
    """The text around the calls and reasoning, stripped of the whitespace that set them apart, and the calls. A text
    with neither is the content exactly as written, as where no tools were offered (what the gateway returns)."""
    visible = strip_thinking(text)
    calls = [parse_body(match.group(1).strip()) for match in _TOOL_CALL.finditer(visible)]
    if not calls and visible == text:
        return text, []
    content = _TOOL_CALL.sub("", visible).strip()
    return content, calls


def format_hermes(name: str, arguments: dict[str, Any]) -> str:
    """One call as a Hermes-format model writes it, the text ``parse_hermes`` reads back."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@register_parser("hermes")
def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3, Hermes)."""

    def parse_body(body: str) -> ToolCall:
        try:
            payload = load_json(body)
        except ValueError as error:
            return ToolCall(error=f"malformed JSON ({_json_error(error)}): {body[:200]!r}")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ToolCall(error=f'expected {{"name": ..., "arguments": {{...}}}}, got {body[:200]!r}')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded
            try:
                arguments = load_json(arguments)
            except ValueError as error:
                return ToolCall(name=payload["name"], error=f"arguments are not valid JSON ({_json_error(error)})")
        if not isinstance(arguments, dict):
            excerpt = reprlib.repr(arguments)  # bounded, whatever the size of what the model sent
            return ToolCall(name=payload["name"], error=f"arguments must be a JSON object, got {excerpt}")
        return ToolCall(name=payload["name"], arguments=arguments)

    return _split_calls(text, parse_body)


# Names stop at "<" too: with only ">" and whitespace ending them, text like "<function=x<function=x..."
# with no ">" made every occurrence scan to the end of the text (quadratic: 13 s on 240 kB).
_FUNCTION = re.compile(r"<function=([^<>\s]+)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^<>\s]+)>(.*?)(</parameter>|$)", re.DOTALL)


@register_parser("qwen3_coder")
def parse_qwen3_coder(text: str) -> tuple[str, list[ToolCall]]:
    """``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>`` (Qwen3-Coder)."""

    def parse_body(body: str) -> ToolCall:
        match = _FUNCTION.search(body)
        if match is None:
            return ToolCall(error=f"expected <function=name>...</function>, got {body[:200]!r}")
        arguments: dict[str, Any] = {}
        for name, raw, _ in _PARAMETER.findall(match.group(2)):
            value = raw.strip("\n")
            try:
                arguments[name] = load_json(value)
            except ValueError:  # not JSON (or too deep for it): the value is the text itself
                arguments[name] = value
        return ToolCall(name=match.group(1), arguments=arguments)

    return _split_calls(text, parse_body)
