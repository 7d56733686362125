"""Anthropic's Messages API at the session gateway (``POST /sessions/<id>/v1/messages``; the ``anthropic`` SDK's
``base_url`` is ``http://HOST:PORT/sessions/<id>``): a request's system prompt, messages and content blocks (text,
tool_use, tool_result, thinking) as the chat messages every route records, and the reply as a Message (text,
tool_use and thinking blocks, ``stop_reason``, ``usage``), plain or as Anthropic's server-sent events.

A reply's blocks sent back unchanged are the reply the session recorded (its text and tool calls), so the
conversation goes on from the sampled ids. A last assistant message is a prefill: rendered open (no end of turn), the
reply continues it (a new segment, unless it is the session's first call); sent back, the prefilled text and the
reply are one assistant message. ``messages/count_tokens`` renders a request's context as a call would, recording
nothing. A tool choice that forces a call (``any``, ``tool``) or forbids parallel ones, and ``stop_sequences``, get
400: the engines cannot honour them exactly. Extra fields: ``token_ids`` (the sampled ids) and ``prompt_token_ids``.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from agentloop.gateway.call import ChatCall, Reply


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations...


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]


Block = Annotated[
    Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    """A client tool; Anthropic's server tools (web search, code execution...) have no schema and are refused."""

    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensBody(BaseModel):
    """A ``messages/count_tokens`` request: a Messages request's context, without what concerns the reply."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesBody(CountTokensBody):
    """A Messages request; fields the gateway does not act on (``temperature``, ``thinking``, ``metadata``...) are
    ignored, since the rollout's sampling params hold anyway. ``max_tokens`` can only lower the per-call cap."""

    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None


def chat_call(body: CountTokensBody) -> ChatCall:
    """The request as the chat messages and tools every route records; a last assistant message is a prefill, which
    the reply continues. ValueError for what the gateway cannot honour exactly: a tool choice that forces a call or
    forbids parallel calls (the engines do not constrain decoding) and stop sequences (they stop on token ids)."""
    choice = body.tool_choice or ToolChoice(type="auto")
    if choice.type in ("any", "tool"):
        raise ValueError(
            f"tool_choice {choice.type!r} is not supported: forcing a tool call needs constrained decoding, which the "
            "rollout's engines do not do; use auto (the model chooses) or none"
        )
    if choice.disable_parallel_tool_use and choice.type == "auto":
        raise ValueError(
            "tool_choice.disable_parallel_tool_use is not supported: the model may call several tools in one reply "
            "(the engines do not constrain decoding); leave it out and run the calls one after another"
        )
    if getattr(body, "stop_sequences", None):
        raise ValueError(
            "stop_sequences is not supported: the rollout's engines stop only on the model's stop tokens, so a reply "
            "would not end where the client asked; leave it out and cut the text on the client side"
        )
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        messages += _assistant_message(blocks) if message.role == "assistant" else _user_messages(blocks)
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description is not None else {}),
                "parameters": tool.input_schema,
            },
        }
        for tool in body.tools or []
    ]
    prefill = body.messages[-1].role == "assistant"
    if prefill and (messages[-1].get("tool_calls") or not messages[-1]["content"]):
        raise ValueError("messages: a last assistant message (a prefill, which the reply continues) must hold text")
    cap = getattr(body, "max_tokens", None)
    return ChatCall(messages, tools or None, cap, bool(tools) and choice.type != "none", prefill)


def _user_messages(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn's blocks in order: each tool result a tool message, the text (and images) between them a user
    message."""
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            messages += _user_message(parts)
            parts = []
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block.content)})
        elif isinstance(block, (TextBlock, ImageBlock)):
            parts.append(block)
        else:
            raise ValueError(f"a user message cannot hold a {block.type} block")
    return messages + _user_message(parts)


def _result(content: str | list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    [message] = _user_message(content) or [{"content": ""}]
    return message["content"]


def _user_message(parts: list[TextBlock | ImageBlock]) -> list[dict[str, Any]]:
    """Text blocks as one text; with images, OpenAI's content parts (which the session takes only for a
    vision-language policy)."""
    if not parts:
        return []
    if all(isinstance(part, TextBlock) for part in parts):
        return [{"role": "user", "content": "".join(part.text for part in parts)}]
    return [{"role": "user", "content": [_content_part(part) for part in parts]}]


def _content_part(part: TextBlock | ImageBlock) -> dict[str, Any]:
    if isinstance(part, TextBlock):
        return {"type": "text", "text": part.text}
    source = part.source
    url = (
        source.get("url")
        if source.get("type") == "url"
        else f"data:{source.get('media_type')};base64,{source.get('data')}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant_message(blocks: list[Any]) -> list[dict[str, Any]]:
    """An assistant turn's blocks as one assistant message: its text, its tool calls, its thinking."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for block in blocks:
        if isinstance(block, TextBlock):
            message["content"] += block.text
        elif isinstance(block, ToolUseBlock):
            call = {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
            message.setdefault("tool_calls", []).append(call)
        elif isinstance(block, ThinkingBlock):
            message["reasoning_content"] = block.thinking
        elif not isinstance(block, RedactedThinkingBlock):
            raise ValueError(f"an assistant message cannot hold a {block.type} block")
    return [message]


def _text(blocks: str | list[TextBlock]) -> str:
    return blocks if isinstance(blocks, str) else "".join(block.text for block in blocks)


# why a reply ended, as Anthropic says it: a reply cut short (by its token cap, or aborted) is max_tokens
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "abort": "max_tokens"}


def message(reply: Reply, model: str) -> dict[str, Any]:
    """The reply as a Message: thinking, text and tool_use blocks in the order the model wrote them."""
    sent = reply.message
    content: list[dict[str, Any]] = []
    if sent["reasoning_content"]:
        content.append({"type": "thinking", "thinking": sent["reasoning_content"], "signature": ""})
    if sent["content"]:
        content.append({"type": "text", "text": sent["content"]})
    for call in sent["tool_calls"] or []:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": function["name"],
                "input": json.loads(function["arguments"]),
            }
        )
    input_tokens, output_tokens = reply.usage()
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _STOP_REASONS.get(reply.choice["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
        "token_ids": reply.choice["token_ids"],
        "prompt_token_ids": reply.context,
    }


async def events(message: dict[str, Any]) -> AsyncIterator[str]:
    """A Message as Anthropic's server-sent events: each block whole in one delta."""
    empty = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 0}}
    stream: list[dict[str, Any]] = [{"type": "message_start", "message": empty}]
    for index, block in enumerate(message["content"]):
        start, delta = _block_start_and_delta(block)
        stream += [
            {"type": "content_block_start", "index": index, "content_block": start},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]
    stream += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        },
        {"type": "message_stop"},
    ]
    for event in stream:
        yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _block_start_and_delta(block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    if block["type"] == "text":
        return {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}, {
            "type": "thinking_delta",
            "thinking": block["thinking"],
        }
    start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
    return start, {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}


# Anthropic's error types by status
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
