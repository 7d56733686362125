"""The session gateway: a base URL per session, ``http://HOST:PORT/sessions/<id>/v1``, served in an agent-loop
worker's process over its router, so that an unmodified agent program (OpenAI SDK, Agents SDK, LangGraph, the
``anthropic`` SDK...) produces trainable trajectories.

Routes per session, three APIs: ``GET models``; ``POST chat/completions`` (OpenAI's Chat Completions: tools,
``tool_choice``, ``n=1``, streaming off or on); ``POST messages`` and ``POST messages/count_tokens`` (Anthropic's
Messages, ``anthropic_api``: the ``anthropic`` SDK's base URL is the session's without ``/v1``); ``POST responses``
(OpenAI's Responses, the Agents SDK's default model, ``responses_api``). Each route translates its request into chat
messages and tools, and every call, whichever API, goes the one way (``Gateway._answer``): recorded in the session
(exact sampled ids for replies sent back, a new segment for rewritten history), through the router under the
session's sample (sticky server, GRPO group affinity, policy versions, continuation across weight pushes), with the
rollout's sampling params whatever the client asks: its ``max_tokens`` can only lower the per-call cap. Unknown,
finished or expired sessions get 404, a wrong key 401 (the key as a bearer token or ``x-api-key``), bad requests 4xx
(a body that fails validation 400, naming the field), a call past the session's token budget 400
(``context_length_exceeded``), each in its API's error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator, TypeVar

import orjson
import uvicorn
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from agentloop.gateway import anthropic_api, responses_api
from agentloop.gateway.call import ChatCall, Reply
from agentloop.gateway.session import Session, SessionLimits, SessionOver
from agentloop.http_server import serve
from agentloop.router import Router
from agentloop.server.http.chat import ChatBody, completion_choice, template_messages, token_spelling
from agentloop.settings import RolloutSettings
from agentloop.tools.parsers import get_parser


# How long ``Gateway.close`` waits for the calls it cancelled to unwind (they stop at once: the router aborts their
# requests without waiting for the engine); a bound, so that a session's end never hangs.
CLOSE_WAIT_S = 10.0

BodyT = TypeVar("BodyT", bound=BaseModel)

# completion ids: unique, not secret (no system call per call, as uuid4's urandom is), and a generator of its own,
# seeded once from the system: a worker that seeds ``random`` for its rollouts does not repeat another's ids
_IDS = random.Random()


class SessionChatBody(ChatBody):
    """A chat completion request as agent frameworks send it: fields the gateway does not act on (``seed``,
    ``parallel_tool_calls``, ``stop``...) are ignored, since the rollout's sampling params hold anyway."""

    model_config = ConfigDict(extra="ignore")
    tool_choice: str | dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None


class GatewayError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class Gateway:
    """Sessions of one router, served on one port; ``open`` a session per sample, ``close`` it when its agent is done.
    An agent-loop worker owns one (``AgentLoopWorker.gateway``), made when a loop first asks for it and stopped with
    the worker."""

    def __init__(
        self,
        router: Router,
        tokenizer: PreTrainedTokenizerBase,
        settings: RolloutSettings,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``settings``: the worker's rollout settings (its servers' model, tool-call format and budgets, and
        ``agent.gateway``); ``template_kwargs``: ``data.apply_chat_template_kwargs``."""
        self.router = router
        self.tokenizer = tokenizer
        self.settings = settings.agent.gateway
        servers = settings.servers
        self.model_name = servers.model_path
        self.template_kwargs = dict(template_kwargs or {})
        self.parse_tool_calls = get_parser(servers.tool_format)
        self.spell = token_spelling(tokenizer)
        self.limits = SessionLimits(
            budget=servers.response_length,
            prompt_length=servers.prompt_length,
            max_model_len=servers.context_length,
            max_tokens_per_call=None,
            deadline=0.0,
        )
        self.sessions: dict[str, Session] = {}
        self.url = ""
        self._started: asyncio.Task | None = None
        self._server: uvicorn.Server | None = None

    async def start(self) -> None:
        """Serve on ``rollout.agent.gateway.host``/``port`` (once; later calls wait for the first)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._serve())
        await asyncio.shield(self._started)

    async def _serve(self) -> None:
        host = self.settings.host
        self._server, port = await serve(self.app(), host, self.settings.port)
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        """Stop serving (its worker is shutting down; the loops whose sessions are open are cancelled with it)."""
        self.sessions.clear()
        if self._server is not None:
            self._server.should_exit = True

    def open(
        self, sampling_params: dict[str, Any], timeout_s: float, max_tokens_per_call: int | None, processor: Any = None
    ) -> Session:
        """A new session for the sample whose loop runs in this task (``Router.running_sample``); ``processor``: the
        policy's, for a vision-language model (its sessions take image parts), else None."""
        sample = Router.current_sample()
        if sample is None:
            raise RuntimeError("Gateway.open must be called from a sample's agent loop (within Router.running_sample)")
        limits = dataclasses.replace(
            self.limits, max_tokens_per_call=max_tokens_per_call, deadline=time.monotonic() + timeout_s
        )
        session = Session(
            secrets.token_urlsafe(24),
            secrets.token_urlsafe(24),
            sample,
            dict(sampling_params),
            limits,
            self.tokenizer,
            self.template_kwargs,
            processor,
        )
        self.sessions[session.id] = session
        return session

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of ``session`` (its ``api_key`` is the key); the ``anthropic`` SDK's is this without
        ``/v1``."""
        return f"{self.url}/sessions/{session.id}/v1"

    async def close(self, session: Session, end: str = "stop") -> None:
        """End the session: later calls get 404, and calls in flight are cancelled (their requests aborted) and
        waited for, so that once this returns the session's trajectory is final and holds nothing of them.
        RuntimeError when they do not stop within ``CLOSE_WAIT_S``: the trajectory could still change."""
        self.sessions.pop(session.id, None)
        session.end = session.end or end
        calls = list(session.in_flight)
        for task in calls:
            task.cancel()
        if calls:
            _, running = await asyncio.wait(calls, timeout=CLOSE_WAIT_S)
            if running:
                raise RuntimeError(
                    f"{len(running)} call(s) of session {_short(session.id)} were still running {CLOSE_WAIT_S:g}s "
                    "after they were cancelled at its close: its trajectory cannot be taken as final"
                )

    def app(self) -> GatewayApp:
        """The gateway's ASGI app (``GatewayApp``): its routes by the path after a session's ``/v1/``."""
        return GatewayApp(
            {
                "models": ("GET", self._models),
                "chat/completions": ("POST", self._chat_completions),
                "messages": ("POST", self._messages),
                "messages/count_tokens": ("POST", self._count_tokens),
                "responses": ("POST", self._responses),
            },
            int(self.settings.max_body_bytes),
        )

    async def _models(self, request: Request, body: bytes) -> Response:
        self._session(request)
        return _Json(
            {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "agentloop"}],
            }
        )

    async def _chat_completions(self, request: Request, raw: bytes) -> Response:
        body = _body(SessionChatBody, raw)
        session = self._session(request)
        if body.n != 1:
            raise ValueError("only n=1 is supported: a session is one trajectory")
        messages, tools = template_messages(body.messages), body.tools or None
        call = ChatCall(
            messages,
            tools,
            body.max_completion_tokens or body.max_tokens,
            bool(tools) and body.tool_choice != "none",
        )
        completion = _chat_completion(await self._answer(session, call), body.model or self.model_name)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_as_events(completion, include_usage), media_type="text/event-stream")
        return _Json(completion)

    async def _messages(self, request: Request, raw: bytes) -> Response:
        body = _body(anthropic_api.MessagesBody, raw)
        reply = await self._answer(self._session(request), anthropic_api.chat_call(body))
        message = anthropic_api.message(reply, body.model or self.model_name)
        if body.stream:
            return StreamingResponse(anthropic_api.events(message), media_type="text/event-stream")
        return _Json(message)

    async def _count_tokens(self, request: Request, raw: bytes) -> Response:
        body = _body(anthropic_api.CountTokensBody, raw)
        session = self._session(request)
        call = anthropic_api.chat_call(body)
        _check_images(session, call.messages)
        return _Json({"input_tokens": session.count(call.messages, call.tools, call.prefill)})

    async def _responses(self, request: Request, raw: bytes) -> Response:
        body = _body(responses_api.ResponsesBody, raw)
        session = self._session(request)
        call = responses_api.chat_call(body, session.responses)
        reply = await self._answer(session, call)
        response = responses_api.response(reply, body, body.model or self.model_name)
        if body.store:
            sent_back = _as_sent_back(reply.message)
            if reply.message["reasoning_content"]:
                sent_back["reasoning_content"] = reply.message["reasoning_content"]
            session.responses[response["id"]] = responses_api.conversation_after(call, body, sent_back)
        if body.stream:
            return StreamingResponse(responses_api.events(response), media_type="text/event-stream")
        return _Json(response)

    async def _answer(self, session: Session, call: ChatCall) -> Reply:
        """``call`` answered and recorded, as a task of the session's calls in flight (its close cancels it: 404)."""
        task = asyncio.ensure_future(self._complete(session, call))
        session.in_flight.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise  # the route's handler itself was cancelled (the client went away)
            raise GatewayError(
                404, f"session {_short(session.id)} ended while this call was in flight", "session_ended"
            ) from None
        finally:
            session.in_flight.discard(task)

    def _session(self, request: Request) -> Session:
        sid = request.path_params["sid"]
        session = self.sessions.get(sid)
        if session is None:
            raise GatewayError(
                404, f"no open session {_short(sid)} (unknown, or its agent finished)", "session_not_found"
            )
        # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key (read from the raw headers, whose
        # names the server gives in lower case: no header mapping built per call)
        key = session.api_key.encode()
        if not any(
            hmac.compare_digest(_sent_key(name, value), key)
            for name, value in request.scope["headers"]
            if name in (b"authorization", b"x-api-key")
        ):
            raise GatewayError(
                401,
                "missing or wrong API key: use the session's key (OPENAI_API_KEY, ANTHROPIC_API_KEY)",
                "invalid_api_key",
            )
        if session.end is not None:
            raise GatewayError(404, f"session {_short(sid)} is over ({session.end})", "session_ended")
        if session.expired:
            session.end = "timeout"
            raise GatewayError(404, f"session {_short(sid)} is past its deadline", "session_expired")
        return session

    async def _complete(self, session: Session, call: ChatCall) -> Reply:
        """Record the call's context, generate the reply through the router and record it."""
        messages = call.messages
        _check_images(session, messages)
        async with session.lock:
            # a call that raises on the way (refused, unrenderable, cancelled by the session's close) leaves nothing
            with session.recording_call():
                try:
                    context = list(session.enter(messages, call.tools, call.prefill))
                except SessionOver as over:
                    raise GatewayError(400, str(over), "context_length_exceeded") from None
                params = dict(session.sampling_params)
                for cap in (session.limits.max_tokens_per_call, call.max_tokens):
                    if cap:
                        params["max_new_tokens"] = min(int(cap), int(params.get("max_new_tokens") or cap))
                trajectory = session.trajectory
                with Router.running_sample(session.sample.request_id, session.sample.group, session.sample.adapter):
                    output, _, end = await trajectory.generate_turn(
                        self.router, session.sample.request_id, params, session.limits.budget
                    )
                parse = self.parse_tool_calls if call.parse_tools else None
                choice = completion_choice(output, context, self.tokenizer, parse, self.spell)
                session.replied(messages, _as_sent_back(choice["message"]), output, end, call.prefill)
        return Reply(choice, context)


def _sent_key(name: bytes, value: bytes) -> bytes:
    """The key a header sends: an ``x-api-key`` value, or an ``authorization`` value's bearer token (else nothing)."""
    if name == b"x-api-key":
        return value
    return value[len(b"Bearer ") :] if value.startswith(b"Bearer ") else b""


def _check_images(session: Session, messages: list[dict[str, Any]]) -> None:
    """ValueError for image parts a session cannot take: any on a text-only policy, and any not sent as data (the
    worker reads no file and fetches no URL for a client)."""
    urls = [
        part["image_url"]["url"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image_url"
    ]
    if urls and session.processor is None:
        raise ValueError("image content parts need a vision-language policy: this session's model is text-only")
    for url in urls:
        if not url.startswith("data:"):
            raise ValueError(f"an image part's url must be a data: URI (base64), got {url[:60]!r}")


def _body(model: type[BodyT], raw: bytes) -> BodyT:
    """A request's body as ``model``, parsed by pydantic straight from its bytes; its errors as FastAPI reports a
    body's (each under ``body``), so that the error handlers answer as for any route."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        problems = error.errors(include_url=False)
        raise RequestValidationError([{**problem, "loc": ("body", *problem["loc"])} for problem in problems]) from None


def _chat_completion(reply: Reply, model: str) -> dict[str, Any]:
    prompt_tokens, completion_tokens = reply.usage()
    return {
        "id": f"chatcmpl-{_IDS.getrandbits(128):032x}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [reply.choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "prompt_token_ids": reply.context,
    }


def _as_sent_back(message: dict[str, Any]) -> dict[str, Any]:
    """The reply as a client sends it back, as templates take it: tool call arguments as objects."""
    calls = [
        {
            "type": "function",
            "function": {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])},
        }
        for call in message.get("tool_calls") or []
    ]
    return {"role": "assistant", "content": message.get("content"), **({"tool_calls": calls} if calls else {})}


async def _as_events(completion: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """A completion as OpenAI's server-sent chunks: the whole message in one delta, then the finish, then usage."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {key: completion[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    chunks = [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


Handler = Callable[[Request, bytes], Awaitable[Response]]

# a session's routes: its id, then the route's path (a trailing slash allowed)
_ROUTE = re.compile(r"/sessions/([^/]+)/v1/(.+?)/?")


class GatewayApp:
    """The gateway's ASGI app: a route by the path after a session's ``/v1/`` and its method (else 404 or 405), the
    body read whole within ``max_bytes`` (declared in ``Content-Length`` or counted as a chunked body streams in: 413
    past it), and errors in the shape of the API the request came in (``_error_response``). The handlers take the
    request and its body and return Starlette responses. Not a Starlette app: its middleware stack, route matching and
    request wrapping were a sixth of an HTTP round trip's CPU (64 sessions at once on a bare route, client included)."""

    def __init__(self, routes: dict[str, tuple[str, Handler]], max_bytes: int) -> None:
        self.routes, self.max_bytes = routes, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # (lifespan events are off, and no websocket is served)
            return
        request = Request(scope, receive)
        try:
            response = await self._respond(request)
        except ClientDisconnect:
            return  # gone before its body arrived: nobody to answer
        except Exception as error:
            response = _error_response(request, error)
        await response(scope, receive, send)

    async def _respond(self, request: Request) -> Response:
        route = _ROUTE.fullmatch(request.scope["path"])
        method, handler = self.routes.get(route[2], ("", None)) if route else ("", None)
        if handler is None:
            return _error(request, 404, f"{request.method} {request.scope['path']}: Not Found", "not_found")
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            text = f"{request.method} {request.scope['path']}: Method Not Allowed"
            return _error(request, 405, text, "method_not_allowed")
        request.scope["path_params"] = {"sid": route[1]}
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > self.max_bytes:
            return self._too_large(request)
        chunks, size = [], 0
        while True:  # (the server reads exactly the declared length; a chunked body is counted as it comes)
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return self._too_large(request)
            if not message.get("more_body"):
                return await handler(request, b"".join(chunks))

    def _too_large(self, request: Request) -> Response:
        message = (
            f"request body over the limit of {self.max_bytes} bytes (actor_rollout_ref.rollout.agent.gateway."
            "max_body_bytes)"
        )
        return _error(request, 413, message, "request_too_large")


def _error_response(request: Request, error: Exception) -> Response:
    """An error in the shape of the API the request came in: Anthropic's on its Messages routes, OpenAI's elsewhere.
    A body that fails validation gets 400 naming the fields, as OpenAI's and Anthropic's APIs answer; any other
    ValueError 400 with its message. Anything else is re-raised (the server answers 500 and logs it)."""
    if isinstance(error, GatewayError):
        return _error(request, error.status, str(error), error.code)
    if isinstance(error, RequestValidationError):
        return _error(request, 400, f"malformed request: {_named_fields(error)}", "invalid_request_error")
    if isinstance(error, ValueError):
        return _error(request, 400, str(error), "invalid_request_error")
    raise error


class _Json(Response):
    """A JSON response encoded by orjson: a completion's token ids and logprobs encode about ten times faster than
    with the standard library (a few percent of a gateway call); the same JSON values."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _named_fields(error: RequestValidationError) -> str:
    """The first problems, each at its field's path (``messages.0.content``). A field that may be text or a list is
    named once, for the list it was sent as (not also for "is not a string"), without pydantic's names of union types."""
    problems = [problem for problem in error.errors() if problem["loc"][-1] != "str"] or error.errors()
    return "; ".join(
        ".".join(str(part) for part in problem["loc"][1:] if not (isinstance(part, str) and "[" in part))
        + f": {problem['msg']}"
        for problem in problems[:3]
    )


def _error(request: Request, status: int, message: str, code: str) -> Response:
    if request.scope["path"].rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens")):
        return _Json(anthropic_api.error_body(status, message), status_code=status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return _Json({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


def _short(sid: str) -> str:
    return f"{sid[:6]}..." if len(sid) > 6 else sid
