"""OpenAI ``/v1/chat/completions`` over a rollout server, with the exact prompt and completion token ids and
logprobs as extra fields so external agent code can produce trainable trajectories.

Images come as OpenAI's ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
content parts (for a vision-language model): the template renders one pad per image, which the model's
processor widens to the image's tokens; ``prompt_token_ids`` holds the widened ids.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
import uuid
from typing import Any, Callable, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tokenizers import decoders
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from agentloop.images import ProcessedImage, split_images
from agentloop.protocol import TokenOutput
from agentloop.server.continued import generate_continued
from agentloop.server.http.native import Admission, ServerImages, weight_versions_json
from agentloop.tools.parsers import Parser, get_parser
from agentloop.tools.reasoning import prompt_opens_reasoning, split_reasoning

# byte-level BPE (GPT-2's, Qwen's, Llama 3's) writes each byte of a token as one printable character;
# SentencePiece's byte fallback (Llama 2's, Mistral's) has a piece per byte for characters it has no piece for
_BYTE_OF_CHARACTER = {character: byte for byte, character in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class ChatMessage(BaseModel):
    """One message; ``content`` is text, a list of text and image parts, or null (an assistant turn of tool calls).
    A ``developer`` message (OpenAI's name for the system role since its o1 models) is a system message."""

    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, name, reasoning_content ride along
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def text_and_image_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list) and not all(_is_text_part(part) or _is_image_part(part) for part in content):
            raise ValueError(
                "content parts must be {type: text, text: ...} or {type: image_url, image_url: {url: ...}}"
            )
        return content


def _as_templates_take_it(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI's message shapes as chat templates expect them (vLLM and SGLang convert them too): a tool call's
    JSON-string ``arguments`` as an object, text-only content parts as one string, and the developer role as the
    system role (open models' templates know no other; Qwen's would drop the message silently)."""
    if message["role"] == "developer":
        message["role"] = "system"
    content = message.get("content")
    if isinstance(content, list) and all(map(_is_text_part, content)):
        message["content"] = "".join(part["text"] for part in content)
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError as error:
                raise ValueError(f"messages[{index}].tool_calls: arguments are not valid JSON ({error})") from None
    return message


def _is_text_part(part: dict[str, Any]) -> bool:
    return part.get("type") == "text" and isinstance(part.get("text"), str)


def _is_image_part(part: dict[str, Any]) -> bool:
    return (
        part.get("type") == "image_url"
        and isinstance(part.get("image_url"), dict)
        and isinstance(part["image_url"].get("url"), str)
    )


class ChatBody(BaseModel):
    """The subset of OpenAI's chat completion request that rollouts use; any other field is an error."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # without either, a reply stops at the engines' default of 128 tokens
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = 1
    stream: bool = False
    # accepted for OpenAI clients that always send them; the answer carries logprobs either way
    logprobs: bool | None = None
    user: str | None = None


def chat_routes(
    server: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    tool_format: str,
    images: ServerImages | None = None,
    admission: Admission | None = None,
) -> APIRouter:
    """``POST /v1/chat/completions``; tool calls in the completion are parsed in ``tool_format``. ``images``: how
    image parts are processed (default: refused, a text-only model); ``admission``: the native routes' pause gate."""
    router = APIRouter()
    parse_tool_calls = get_parser(tool_format)
    spell = token_spelling(tokenizer)
    images = images or ServerImages(None, tokenizer)
    admission = admission or Admission()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> dict[str, Any]:
        if body.stream or body.n != 1:
            raise ValueError("only stream=false and n=1 are supported")
        prompt, processed = await render_prompt(body, tokenizer, images)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # a weight push mid-request interrupts it: continued here, as the router does, since an OpenAI client
        # cannot resume a cut-off message
        async with admission.admitted(request_id):
            output, versions, _ = await generate_continued(
                lambda ids, more: server.generate(ids, more, request_id, images=processed or None),
                prompt,
                engine_params(body),
            )
        choice = completion_choice(output, prompt, tokenizer, parse_tool_calls if body.tools else None, spell)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(output.token_ids),
                "total_tokens": len(prompt) + len(output.token_ids),
            },
            "prompt_token_ids": prompt,
            # which weights sampled which tokens (a reply continued across a weight push has two spans)
            "metadata": weight_versions_json(versions, output.policy_version),
        }

    return router


async def render_prompt(
    body: ChatBody, tokenizer: PreTrainedTokenizerBase, images: ServerImages
) -> tuple[list[int], list[ProcessedImage]]:
    """The request's messages through the chat template: the prompt's ids, each image's pad widened to its
    tokens, and the processed images in order. ValueError for messages or images the server cannot take."""
    messages = template_messages(body.messages)
    pictures: list[Any] = []
    if any(
        isinstance(message.get("content"), list) and any(map(_is_image_part, message["content"]))
        for message in messages
    ):
        # decoding images takes a while: off the event loop, which serves every request
        messages, pictures = await asyncio.to_thread(split_message_images, messages)
    processed = await images.process(pictures, "messages' images")
    try:
        prompt = list(
            tokenizer.apply_chat_template(
                messages, tools=body.tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    except (
        Exception
    ) as error:  # the template's own checks (jinja raise_exception, bad tool schemas): the client's input
        raise ValueError(f"the chat template cannot render these messages: {type(error).__name__}: {error}") from error
    return images.expand(prompt, processed, "the rendered messages"), processed


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them (``_as_templates_take_it``); ValueError for bad arguments."""
    return [_as_templates_take_it(message.model_dump(exclude_none=True), i) for i, message in enumerate(messages)]


def engine_params(body: ChatBody) -> dict[str, Any]:
    """The request's sampling settings as the engine's params."""
    params: dict[str, Any] = {"temperature": body.temperature, "top_p": body.top_p}
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens:
        params["max_new_tokens"] = max_tokens
    return params


def completion_choice(
    output: TokenOutput,
    prompt: list[int],
    tokenizer: PreTrainedTokenizerBase,
    parse_tool_calls: Parser | None,
    spell: Callable[[int], tuple[str, list[int] | None]],
) -> dict[str, Any]:
    """The completion's one choice: the reply split into reasoning, content and tool calls (``parse_tool_calls``:
    None when the request offered no tools), why it ended, and its exact tokens with their logprobs."""
    ids = output.token_ids[:-1] if output.finish_reason == "stop" else output.token_ids
    reasoning, visible = split_reasoning(
        tokenizer.decode(ids, skip_special_tokens=False), opened=prompt_opens_reasoning(tokenizer, prompt)
    )
    content, calls = parse_tool_calls(visible) if parse_tool_calls else (visible, [])
    if any(call.error is not None for call in calls):  # the client sees what the model wrote, as vLLM's does
        content, calls = visible, []
    tool_calls = [_tool_call(call.name, call.arguments) for call in calls]
    # a reply cut short says so: "abort" as SGLang's OpenAI front reports it, or "length"
    finish = {"abort": "abort", "length": "length"}.get(output.finish_reason, "tool_calls" if tool_calls else "stop")
    logprobs = [
        {"token": text, "logprob": lp, "bytes": spelled, "top_logprobs": []}
        for (text, spelled), lp in zip(map(spell, output.token_ids), output.log_probs)
    ]
    return {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": content if (content or not tool_calls) else None,
            "reasoning_content": reasoning,
            "tool_calls": tool_calls or None,
        },
        "finish_reason": finish,
        "logprobs": {"content": logprobs},
        # exact tokens for training: what was sampled, with the engine's logprobs
        "token_ids": output.token_ids,
    }


def token_spelling(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], tuple[str, list[int] | None]]:
    """A token id's text and exact bytes (``token_bytes``), as each logprob entry of a completion gives them (OpenAI's
    ``token`` and ``bytes``): worked out once per id, so that an entry costs a lookup rather than a decode (about
    9 µs a token, which at a few hundred tokens a reply was a gateway call's largest cost after the chat template)."""
    spell = token_bytes(tokenizer)

    @functools.lru_cache(maxsize=1 << 17)
    def spelling(token: int) -> tuple[str, list[int] | None]:
        return tokenizer.decode([token]), spell(token)

    return spelling


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], list[int] | None]:
    """OpenAI's ``bytes`` of a token id: its exact UTF-8 bytes, which may hold part of a character (joined, a
    reply's tokens' bytes are its text): a byte-level BPE piece's bytes, a byte-fallback piece's byte
    (``<0xE2>``), a SentencePiece piece's text (``▁`` a space); an added token's text. None for an added
    token that decodes to a piece of a character."""
    added = set(tokenizer.added_tokens_decoder)
    byte_level = isinstance(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None), decoders.ByteLevel)

    def spell(token: int) -> list[int] | None:
        piece = tokenizer.convert_ids_to_tokens(token)
        if token in added or not isinstance(piece, str):
            text = tokenizer.decode([token])
            return None if "\ufffd" in text else list(text.encode())
        if byte_level and all(character in _BYTE_OF_CHARACTER for character in piece):  # not so in a vocab gone wrong
            return [_BYTE_OF_CHARACTER[character] for character in piece]
        if _BYTE_FALLBACK.fullmatch(piece):
            return [int(piece[3:5], 16)]
        return list(piece.replace("\u2581", " ").encode())

    return spell


def split_message_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages with each ``image_url`` part as a bare ``{"type": "image"}`` part (one pad in the template),
    and the images in order, read from their URLs.

    Only content lists are looked at: a client's plain text is literal, never verl's ``<image>`` placeholder.
    """
    normalized, found = [], []
    for index, message in enumerate(messages):
        if isinstance(message.get("content"), list) and any(_is_image_part(part) for part in message["content"]):
            [message], pictures = split_images([message], None, f"messages[{index}]")
            found += pictures
        normalized.append(message)
    return normalized, found


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One parsed call as OpenAI's API returns it.

    The arguments keep non-ASCII characters as they are (no ``\\u`` escapes): a client that sends the
    assistant message back then gets it rendered as the model wrote it, not as different tokens.
    """
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": function}
