"""Tool-call parsers, chosen by ``multi_turn.format``. New formats register with ``@register_parser``.

A parser turns a model turn's text into ``(content, calls)``. Reasoning inside ``<think>…</think>``
(or after an unclosed ``<think>``) is never parsed: a call the model only thought about is not made.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from agentloop.tools.schema import ToolCall

Parser = Callable[[str], tuple[str, list[ToolCall]]]
_PARSERS: dict[str, Parser] = {}

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


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


def _split_calls(text: str, parse_body: Callable[[str], ToolCall]) -> tuple[str, list[ToolCall]]:
    visible = strip_thinking(text)
    calls = [parse_body(match.group(1).strip()) for match in _TOOL_CALL.finditer(visible)]
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
            payload = json.loads(body)
        except json.JSONDecodeError as error:
            return ToolCall(error=f"malformed JSON ({error.msg} at position {error.pos}): {body[:200]!r}")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ToolCall(error=f'expected {{"name": ..., "arguments": {{...}}}}, got {body[:200]!r}')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments JSON-encoded
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                return ToolCall(name=payload["name"], error=f"arguments are not valid JSON ({error.msg})")
        if not isinstance(arguments, dict):
            return ToolCall(name=payload["name"], error=f"arguments must be a JSON object, got {arguments!r}")
        return ToolCall(name=payload["name"], arguments=arguments)

    return _split_calls(text, parse_body)


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(</parameter>|$)", re.DOTALL)


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
                arguments[name] = json.loads(value)
            except json.JSONDecodeError:
                arguments[name] = value
        return ToolCall(name=match.group(1), arguments=arguments)

    return _split_calls(text, parse_body)
