"""HTTP front of a rollout server (FastAPI): SGLang's native ``/generate`` and OpenAI chat completions.

``/generate`` speaks SGLang's token-in/token-out shape (``input_ids``, ``sampling_params``, ``rid``,
``return_logprob`` → ``output_ids``, ``meta_info.output_token_logprobs``, ``meta_info.finish_reason``,
``meta_info.cached_tokens``), so SGLang clients (our ``sglang`` backend included) can drive it.
``/v1/chat/completions`` takes messages and tools and answers in OpenAI's shape, with the prompt and
completion token ids and their logprobs as extra fields, so external agent code can produce
trainable trajectories. Served by uvicorn on the server actor's own event loop.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from agentloop.protocol import SAMPLING_DEFAULTS, TokenOutput
from agentloop.tools.parsers import get_parser

# SGLang sampling keys accepted here; the text-only ones have no effect on token ids.
TEXT_ONLY_KEYS = {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"}
SGLANG_TOP_K_DISABLED = 1 << 30


class GenerateBody(BaseModel):
    """SGLang's ``/generate`` request, single-prompt form."""

    model_config = ConfigDict(extra="ignore")
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    rid: str | None = None
    return_logprob: bool = False
    stream: bool = False


class ChatBody(BaseModel):
    """The subset of OpenAI's chat completion request that rollouts use."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False


def sglang_to_engine_params(params: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Map SGLang sampling params onto the engine's, rejecting keys neither knows."""
    unknown = sorted(set(params) - set(SAMPLING_DEFAULTS) - TEXT_ONLY_KEYS)
    if unknown:
        raise ValueError(f"unsupported sampling_params {unknown}; supported: {sorted(set(SAMPLING_DEFAULTS) | TEXT_ONLY_KEYS)}")
    mapped = {key: value for key, value in params.items() if key in SAMPLING_DEFAULTS}
    if mapped.get("top_k") is not None and mapped["top_k"] >= min(SGLANG_TOP_K_DISABLED, vocab_size):
        mapped["top_k"] = -1
    return mapped


def finish_reason_json(output: TokenOutput) -> dict[str, Any]:
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": output.token_ids[-1] if output.token_ids else None}
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output.token_ids)}
    return {"type": "abort", "message": "aborted"}


def build_app(server: Any, tokenizer: PreTrainedTokenizerBase, *, model_name: str, tool_format: str, api_key: str | None) -> FastAPI:
    """The app over a ``RolloutServer``'s engine (anything with async ``generate`` and ``abort``)."""
    app = FastAPI(title="agentloop rollout server")
    engine = server.engine
    parse_tool_calls = get_parser(tool_format)

    async def authorize(request: Request) -> None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(status_code=401, detail="missing or wrong API key (Authorization: Bearer <key>)")

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, error: ValueError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {"message": str(error), "code": 400}})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health_generate", dependencies=[Depends(authorize)])
    async def health_generate() -> dict[str, str]:
        await server.generate([tokenizer.eos_token_id or 0], {"max_new_tokens": 1}, f"health-{uuid.uuid4()}")
        return {"status": "ok"}

    @app.post("/generate", dependencies=[Depends(authorize)])
    async def generate(body: GenerateBody) -> dict[str, Any]:
        if body.stream:
            raise ValueError("stream=true is not supported by this server; send stream=false")
        if body.input_ids is None and body.text is None:
            raise ValueError("send input_ids (token ids) or text")
        ids = body.input_ids if body.input_ids is not None else tokenizer.encode(body.text, add_special_tokens=False)
        rid = body.rid or uuid.uuid4().hex
        start = time.perf_counter()
        output = await server.generate(ids, sglang_to_engine_params(body.sampling_params, engine.vocab_size), rid)
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": len(ids),
            "completion_tokens": len(output.token_ids),
            "finish_reason": finish_reason_json(output),
            "cached_tokens": output.cached_tokens,
            "e2e_latency": time.perf_counter() - start,
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [[lp, token, None] for lp, token in zip(output.log_probs, output.token_ids)]
        return {"text": tokenizer.decode(output.token_ids, skip_special_tokens=True), "output_ids": output.token_ids, "meta_info": meta}

    @app.post("/abort_request", dependencies=[Depends(authorize)])
    async def abort_request(body: dict[str, Any]) -> dict[str, Any]:
        return {"aborted": await server.abort(str(body.get("rid", "")))}

    # Weight and memory control in SGLang's shapes, so the sglang backend's client can drive this server.
    @app.post("/begin_weight_update", dependencies=[Depends(authorize)])
    @app.post("/end_weight_update", dependencies=[Depends(authorize)])
    async def weight_update_session() -> dict[str, Any]:
        return {"success": True, "message": "weight updates here are atomic; no session to open or close"}

    @app.post("/update_weights_from_disk", dependencies=[Depends(authorize)])
    async def update_weights_from_disk(body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("model_path"):
            raise ValueError("update_weights_from_disk needs model_path")
        await server.update_weights_from_disk(body["model_path"])
        return {"success": True, "message": f"loaded {body['model_path']}", "num_paused_requests": 0}

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=[Depends(authorize)])
    async def flush_cache() -> dict[str, Any]:
        engine.flush_cache()
        return {"success": True}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"], dependencies=[Depends(authorize)])
    async def release_memory_occupation() -> dict[str, Any]:
        await server.sleep()
        return {"success": True}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"], dependencies=[Depends(authorize)])
    async def resume_memory_occupation() -> dict[str, Any]:
        await server.wake_up()
        return {"success": True}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatBody) -> dict[str, Any]:
        if body.stream or body.n != 1:
            raise ValueError("only stream=false and n=1 are supported")
        prompt = list(
            tokenizer.apply_chat_template(
                body.messages, tools=body.tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        params = {"temperature": body.temperature, "top_p": body.top_p}
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens:
            params["max_new_tokens"] = max_tokens
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        output = await server.generate(prompt, params, request_id)
        ids = output.token_ids[:-1] if output.finish_reason == "stop" else output.token_ids
        text = tokenizer.decode(ids, skip_special_tokens=False)
        content, calls = parse_tool_calls(text) if body.tools else (text, [])
        tool_calls = [
            {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls
            if c.error is None
        ]
        finish = "tool_calls" if tool_calls else ("length" if output.finish_reason == "length" else "stop")
        logprobs = [
            {"token": tokenizer.decode([token]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for token, lp in zip(output.token_ids, output.log_probs)
        ]
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content if (content or not tool_calls) else None, "tool_calls": tool_calls or None},
                    "finish_reason": finish,
                    "logprobs": {"content": logprobs},
                    # exact tokens for training: what was sampled, with the engine's logprobs
                    "token_ids": output.token_ids,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(output.token_ids),
                "total_tokens": len(prompt) + len(output.token_ids),
            },
            "prompt_token_ids": prompt,
        }

    return app


async def serve(app: FastAPI, host: str, port: int, timeout_s: float = 30.0) -> tuple[uvicorn.Server, int]:
    """Start uvicorn on the running loop (port 0: any free port); return the server and its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if task.done():
            task.result()  # re-raises the start-up error
            raise RuntimeError(f"the HTTP server on {host}:{port} stopped during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the HTTP server on {host}:{port} did not start within {timeout_s}s")
        await asyncio.sleep(0.01)
    return server, sock.getsockname()[1]
