"""The rollout server's FastAPI app: API-key check, ValueError → 400, the native and chat routes."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from agentloop.server.engine import EngineAsleep
from agentloop.server.http.chat import chat_routes
from agentloop.server.http.native import Admission, ServerImages, native_routes


def build_app(
    server: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    tool_format: str,
    api_key: str | None,
    max_body_bytes: int = 32 << 20,
    processor: Any | None = None,
) -> FastAPI:
    """The app over a ``RolloutServer`` (async ``generate``, ``abort``, weight, memory and cache controls).

    Bodies over ``max_body_bytes`` get 413 before they are read; malformed or mistyped bodies 422, bad
    values 400 (unreadable images, or images for a text-only model, among them); a missing or wrong API key 401.
    With an ``api_key`` the schema and docs pages (``/openapi.json``, ``/docs``) are not served.
    ``processor``: the model's processor for image inputs (``agentloop.models.loading.load_processor``),
    None for a text-only model.
    """
    images = ServerImages(processor, tokenizer)
    # a browser cannot send the key to the interactive docs: with a key they are off, not open to anyone
    docs = {} if not api_key else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="agentloop rollout server", **docs)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    async def authorize(request: Request) -> None:
        if api_key and not hmac.compare_digest(
            request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()
        ):
            raise HTTPException(status_code=401, detail="missing or wrong API key (Authorization: Bearer <key>)")

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, error: ValueError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {"message": str(error), "code": 400}})

    @app.exception_handler(EngineAsleep)
    async def asleep(_: Request, error: EngineAsleep) -> JSONResponse:  # the trainer released the KV cache for a while
        return JSONResponse(status_code=503, content={"error": {"message": str(error), "code": 503}})

    # liveness probes carry no key, so /health stays outside the authorized routers
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    authorized, admission = [Depends(authorize)], Admission()
    app.include_router(native_routes(server, tokenizer, images, admission), dependencies=authorized)
    chat = chat_routes(
        server, tokenizer, model_name=model_name, tool_format=tool_format, images=images, admission=admission
    )
    app.include_router(chat, dependencies=authorized)
    return app


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``, declared in ``Content-Length`` or, for a
    chunked body, counted as it streams in (read whole before the route sees it: a route's own body parser
    would turn an error raised mid-read into a 400)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:  # the HTTP server reads exactly that many bytes
            if int(declared) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while not messages or (messages[-1]["type"] == "http.request" and messages[-1].get("more_body")):
            messages.append(await receive())
            size += len(messages[-1].get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
        buffered = iter(messages)

        async def replayed() -> dict:
            return next(buffered, None) or await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        message = (
            f"request body over the limit of {self.max_bytes} bytes (actor_rollout_ref.rollout.http.max_body_bytes)"
        )
        await JSONResponse(status_code=413, content={"error": {"message": message, "code": 413}})(scope, receive, send)
