"""OpenAI's Responses API at the session gateway (``POST /sessions/<id>/v1/responses``, the OpenAI base URL's; the
OpenAI Agents SDK's default model): a request's ``instructions`` and ``input`` items (messages, function_call,
function_call_output, reasoning) as the chat messages every route records, and the reply as a Response whose output
items are reasoning, message and function_call, plain or as the API's server-sent events.

A client sends the whole conversation each call, or names a response of its session as ``previous_response_id`` and
sends what follows it: the session keeps each response's conversation (unless ``store`` is false; the API's
``conversation`` objects are refused). ``tool_choice`` ``auto`` or ``none``; one that forces a call (``required``, a
named tool, ``allowed_tools``) gets 400, since the engines do not constrain decoding. Output items sent back unchanged
are the reply the session recorded (its text and tool calls), so the conversation goes on from the sampled ids. Extra
fields: ``token_ids`` (the sampled ids) and ``prompt_token_ids``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from agentloop.gateway.call import ChatCall, Reply


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status, annotations, logprobs, encrypted_content...


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Item):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Item):
    type: Literal["input_image"]
    image_url: str


Part = Annotated[Union[TextPart, RefusalPart, ImagePart], Field(discriminator="type")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None


def _item_type(item: Any) -> str | None:
    """An item's ``type``; a message may leave it out (``{"role": "user", "content": "..."}``)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


Item = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
    ],
    Discriminator(_item_type),
]


class FunctionTool(_Item):
    """A function tool; the API's hosted tools (web search, file search, computer...) are refused."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesBody(BaseModel):
    """A Responses request; fields the gateway does not act on (``temperature``, ``reasoning``, ``store``,
    ``include``, ``text``...) are ignored, since the rollout's sampling params hold anyway. ``max_output_tokens`` can
    only lower the per-call cap."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None


def chat_call(body: ResponsesBody, stored: dict[str, list[dict[str, Any]]]) -> ChatCall:
    """The request as the chat messages and tools every route records: the conversation of its
    ``previous_response_id`` (in ``stored``, the session's) and then its input. ValueError for a response the session
    did not store, ``conversation`` objects, a tool choice that forces a call, and function call arguments that are
    not JSON."""
    if body.conversation is not None:
        raise ValueError(
            "conversation is not supported: the gateway keeps no conversation objects; send the whole conversation in "
            "`input`, or name the last response as previous_response_id"
        )
    if body.tool_choice not in (None, "auto", "none"):
        raise ValueError(
            f"tool_choice {body.tool_choice!r} is not supported: forcing a tool call needs constrained decoding, which "
            "the rollout's engines do not do; use auto (the model chooses) or none"
        )
    history = stored.get(body.previous_response_id or "", [])
    if body.previous_response_id is not None and body.previous_response_id not in stored:
        raise ValueError(
            f"previous_response_id {body.previous_response_id!r} is not a stored response of this session (each "
            "session keeps its own responses, those made with store=true)"
        )
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += history
    for index, item in enumerate(items):
        _add(messages, item, index)
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description is not None else {}),
                "parameters": tool.parameters or {"type": "object", "properties": {}},
            },
        }
        for tool in body.tools or []
    ]
    return ChatCall(messages, tools or None, body.max_output_tokens, bool(tools) and body.tool_choice != "none")


def conversation_after(call: ChatCall, body: ResponsesBody, reply: dict[str, Any]) -> list[dict[str, Any]]:
    """What a response's ``previous_response_id`` stands for: its call's messages and its reply (as a client sends it
    back), without the call's instructions, which the API does not carry over to the next response."""
    return [*call.messages[1 if body.instructions else 0 :], reply]


def _add(messages: list[dict[str, Any]], item: Any, index: int) -> None:
    """One input item added to the chat messages. The items of one reply (reasoning, then its message, then its
    function calls) make one assistant message; a reasoning item, or a message after text or calls, opens the next."""
    if isinstance(item, FunctionCallOutputItem):
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
        return
    if isinstance(item, MessageItem) and item.role != "assistant":
        role = "system" if item.role == "developer" else item.role  # (as the chat route takes it)
        messages.append({"role": role, "content": _content(item.content)})
        return
    last = messages[-1] if messages else {}
    said = last.get("role") == "assistant" and (last.get("content") or last.get("tool_calls"))
    if last.get("role") != "assistant" or (said and not isinstance(item, FunctionCallItem)):
        messages.append({"role": "assistant", "content": ""})
    reply = messages[-1]
    if isinstance(item, ReasoningItem):
        parts = item.content if item.content is not None else item.summary
        reply["reasoning_content"] = "".join(str(part.get("text", "")) for part in parts)
    elif isinstance(item, MessageItem):
        reply["content"] = _content(item.content)
    else:
        try:
            arguments = json.loads(item.arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"input[{index}].arguments is not valid JSON ({error})") from None
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
        reply.setdefault("tool_calls", []).append(call)


def _content(content: str | list[Any]) -> str | list[dict[str, Any]]:
    """Text parts as one text; with images, the chat API's content parts (which the session takes only for a
    vision-language policy)."""
    if isinstance(content, str):
        return content
    if not any(isinstance(part, ImagePart) for part in content):
        return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in content)
    return [
        {"type": "image_url", "image_url": {"url": part.image_url}}
        if isinstance(part, ImagePart)
        else {"type": "text", "text": part.text if isinstance(part, TextPart) else part.refusal}
        for part in content
    ]


def response(reply: Reply, body: ResponsesBody, model: str) -> dict[str, Any]:
    """The reply as a Response: its reasoning, message and function_call output items in the order the model wrote
    them; ``incomplete`` (``max_output_tokens``) when it was cut short."""
    sent = reply.message
    output: list[dict[str, Any]] = []
    if sent["reasoning_content"]:
        text = {"type": "reasoning_text", "text": sent["reasoning_content"]}
        output.append({"type": "reasoning", "id": _id("rs"), "summary": [], "content": [text]})
    if sent["content"] or not sent["tool_calls"]:
        text = {"type": "output_text", "text": sent["content"] or "", "annotations": [], "logprobs": []}
        output.append(
            {"type": "message", "id": _id("msg"), "role": "assistant", "status": "completed", "content": [text]}
        )
    for call in sent["tool_calls"] or []:
        function = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    cut = reply.choice["finish_reason"] in ("length", "abort")
    input_tokens, output_tokens = reply.usage()
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": model,
        "instructions": body.instructions,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "tool_choice": body.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "temperature": None,
        "top_p": None,
        "max_output_tokens": body.max_output_tokens,
        "metadata": {},
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "token_ids": reply.choice["token_ids"],
        "prompt_token_ids": reply.context,
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def events(response: dict[str, Any]) -> AsyncIterator[str]:
    """A Response as the API's server-sent events: created, each output item added and done (its text or arguments
    whole in one delta), then completed (or incomplete) with the whole Response."""
    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    stream: list[dict[str, Any]] = [{"type": "response.created", "response": pending}]
    for index, item in enumerate(response["output"]):
        stream.append({"type": "response.output_item.added", "output_index": index, "item": _opened(item)})
        stream += _item_deltas(item, index)
        stream.append({"type": "response.output_item.done", "output_index": index, "item": item})
    finished = "response.completed" if response["status"] == "completed" else "response.incomplete"
    stream.append({"type": finished, "response": response})
    for number, event in enumerate(stream):
        yield f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number}, ensure_ascii=False)}\n\n"


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "content": []}


def _item_deltas(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        arguments = item["arguments"]
        return [
            {"type": "response.function_call_arguments.delta", **at, "delta": arguments},
            {"type": "response.function_call_arguments.done", **at, "arguments": arguments},
        ]
    if item["type"] == "reasoning":
        text = item["content"][0]["text"]
        return [
            {"type": "response.reasoning_text.delta", **at, "content_index": 0, "delta": text},
            {"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text},
        ]
    part = item["content"][0]
    at = {**at, "content_index": 0}
    return [
        {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", **at, "delta": part["text"], "logprobs": []},
        {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **at, "part": part},
    ]
