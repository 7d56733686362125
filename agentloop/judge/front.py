"""verl's ``reward_router_address`` for a generative judge: an HTTP front in the agent-loop worker's process whose calls
go through the worker's ``Judge`` and are recorded as the calling sample's.

verl gives a GenRM reward function the ``host:port`` of a router over the reward model's servers, and the function
posts to ``f"http://{address}/v1/chat/completions"``. Here each sample being scored has an address of its own,
``127.0.0.1:PORT/samples/<token>``: the token says whose call it is, so every call is a ``JudgeCall`` of that sample
(``SampleScore.judge_calls``, the ``judge/*`` metrics), and it goes through the judge's ``Router`` as
``judge.chat`` does (placed, probed and re-homed like the policy's turns). An address serves while its sample is
scored; a call after that gets 404. The front starts on the worker's event loop the first time a reward function asks
for an address, on the loopback interface: the function runs in the worker's process.

Routes under an address: ``POST /v1/chat/completions`` and SGLang's ``POST /generate``, as a rollout server's HTTP front
serves them (``agentloop.server.http``), without its weight, memory and admission controls. A call's
``max_tokens`` (``max_new_tokens``) is capped at ``reward_model.rollout.response_length``; a judge call that fails or
times out (``reward_model.timeout_s``) answers 502 with the ``JudgeError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from contextvars import ContextVar
from typing import Any, Iterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from agentloop.http_server import serve
from agentloop.judge.session import JudgeCall, JudgeError, recording
from agentloop.protocol import TokenOutput
from agentloop.router import Router
from agentloop.server.http.chat import ChatBody, completion_choice, engine_params, render_prompt, token_spelling
from agentloop.server.http.native import Admission, ServedAdapter, ServerImages, add_generation_routes
from agentloop.tools.parsers import get_parser

HOST = "127.0.0.1"
PREFIX = "/samples/"

# the token of the sample being scored in this asyncio task (``JudgeFront.admitting``)
_token: ContextVar[str | None] = ContextVar("agentloop_judge_front_token", default=None)


class JudgeFront:
    """The HTTP front of one worker's judge; ``admitting`` gives a sample its address, ``address`` serves it."""

    def __init__(self, judge: Any, model_name: str, tool_format: str) -> None:
        self.judge = judge  # the worker's agentloop.judge.Judge (whose module imports this one)
        self.model_name, self.tool_format = model_name, tool_format
        self.samples: dict[str, tuple[str, list[JudgeCall]]] = {}  # token -> (the sample's request id, its calls)
        self.port: int | None = None
        self._app: FastAPI | None = None
        self._started: asyncio.Future | None = None

    @contextlib.contextmanager
    def admitting(self, sample: str, calls: list[JudgeCall]) -> Iterator[None]:
        """Within it, the sample ``sample`` (its request id) has an address; calls to it are recorded in ``calls``."""
        token = secrets.token_urlsafe(16)
        self.samples[token] = (sample, calls)
        reset = _token.set(token)
        try:
            yield
        finally:
            _token.reset(reset)
            self.samples.pop(token, None)

    async def address(self) -> str:
        """The address of the sample being scored in this task, ``host:port/samples/<token>`` (serving from the first
        call on)."""
        token = _token.get()
        if token is None:
            raise RuntimeError("reward_router_address belongs to a sample: ask for it while a sample is scored")
        if self._started is None:
            self._started = asyncio.ensure_future(self._serve())
        await asyncio.shield(self._started)
        return f"{HOST}:{self.port}{PREFIX}{token}"

    async def _serve(self) -> None:
        self._app = self._routes()
        _, self.port = await serve(self, HOST, 0)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """ASGI: a call under a sample's address runs the routes as that sample's, the address's prefix removed."""
        if scope["type"] != "http":
            return
        path = scope["path"]
        token, _, rest = path[len(PREFIX) :].partition("/") if path.startswith(PREFIX) else ("", "", "")
        entry = self.samples.get(token)
        if entry is None:
            message = (
                "no sample is scored at this address: a sample's reward_router_address serves while its reward "
                "is computed"
            )
            refusal = JSONResponse(status_code=404, content={"error": {"message": message, "code": 404}})
            return await refusal(scope, receive, send)
        sample, calls = entry
        inner = {**scope, "path": f"/{rest}", "raw_path": f"/{rest}".encode()}
        with recording(calls), Router.running_sample(sample):
            await self._app(inner, receive, send)

    def _routes(self) -> FastAPI:
        app = FastAPI(title="agentloop judge front", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ValueError)
        async def bad_request(_: Request, error: ValueError) -> JSONResponse:
            return JSONResponse(status_code=400, content={"error": {"message": str(error), "code": 400}})

        @app.exception_handler(JudgeError)
        async def judge_failed(_: Request, error: JudgeError) -> JSONResponse:
            return JSONResponse(status_code=502, content={"error": {"message": str(error), "code": 502}})

        engine, tokenizer = _ThroughTheJudge(self.judge), self.judge.tokenizer
        images = ServerImages(None, tokenizer)  # a text-only model's: image parts are refused (400)
        parse_tool_calls, spell = get_parser(self.tool_format), token_spelling(tokenizer)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatBody) -> dict[str, Any]:
            """A judge server's chat route, less its ``metadata`` (the weights that sampled the reply: a judge's never
            change), which OpenAI's ``ChatCompletion`` (what verl's GenRM functions read the answer into) refuses."""
            if body.stream or body.n != 1:
                raise ValueError("only stream=false and n=1 are supported")
            prompt, _ = await render_prompt(body, tokenizer, images)
            output = await engine.generate(prompt, engine_params(body), "")
            choice = completion_choice(output, prompt, tokenizer, parse_tool_calls if body.tools else None, spell)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(output.token_ids)}
            return {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model or self.model_name,
                "choices": [choice],
                "usage": {**usage, "total_tokens": sum(usage.values())},
                "prompt_token_ids": prompt,
            }

        generation = APIRouter()
        add_generation_routes(generation, engine, tokenizer, images, Admission(), ServedAdapter())  # (no adapters)
        app.include_router(generation)
        return app


class _ThroughTheJudge:
    """The ``generate`` the servers' HTTP routes call, here the worker's judge: each call one ``JudgeCall``."""

    def __init__(self, judge: Any) -> None:
        self.judge = judge

    async def generate(
        self, ids: list[int], params: dict[str, Any], request_id: str, images: Any = None
    ) -> TokenOutput:
        """``params`` within the judge's budget; ``request_id`` is the client's (the judge's router names its own
        sessions), ``images`` always none (refused before)."""
        budget = int(self.judge.sampling["max_new_tokens"])  # reward_model.rollout.response_length
        asked = int(params.get("max_new_tokens") or budget)
        return await self.judge.sample(ids, **{**params, "max_new_tokens": min(asked, budget)})
