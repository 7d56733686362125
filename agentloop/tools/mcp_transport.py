"""The transport under a long-lived MCP session: the ``mcp`` client's stdio or HTTP transport, watched.

Two things the supervisor needs that the ``mcp`` transports do not report: the moment the server's
output ends (a stdio server's process exited), and what the server last wrote to stderr (the cause of
a crash or a failed start, for the error message the model and the operator see).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, TextIO

import anyio


class StderrTail:
    """The last ``limit`` bytes a server process wrote to stderr.

    ``stdio_client`` hands ``errlog`` to the subprocess as its stderr, so it must be a real file: a pipe
    whose read end a daemon thread drains. A pipe (not a temporary file) keeps the memory bounded
    however long the server lives and logs, and the thread ends by itself when the process exits.
    """

    def __init__(self, limit: int = 2000) -> None:
        read_fd, write_fd = os.pipe()
        self.writer: TextIO = os.fdopen(write_fd, "w")
        self._limit = limit
        self._tail = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, args=(read_fd,), name="mcp-server-stderr", daemon=True).start()

    def _drain(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                with self._lock:
                    self._tail += chunk
                    del self._tail[: -self._limit]

    def close_writer(self) -> None:
        """Drop this process's copy of the write end once the child holds its own, so EOF comes when it exits."""
        if not self.writer.closed:
            self.writer.close()

    def text(self) -> str:
        """The tail as text, whitespace-trimmed ('' when the server wrote nothing)."""
        with self._lock:
            return self._tail.decode("utf-8", "replace").strip()


class EndWatchingStream:
    """A transport read stream that calls ``on_end`` when the server's messages end (EOF or closed).

    The session's dispatcher reads through it; ``on_end`` runs before the dispatcher sees the end and
    fails the requests in flight, so the cause is recorded by the time those calls report it.
    """

    def __init__(self, inner: Any, on_end: Callable[[], None]) -> None:
        self._inner = inner
        self._on_end = on_end

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_end()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> EndWatchingStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> EndWatchingStream:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()


@asynccontextmanager
async def watched_transport(
    target: Any, stderr: StderrTail | None, on_end: Callable[[], None], grace_s: Callable[[], float]
) -> AsyncIterator[tuple[Any, Any]]:
    """A stdio server for ``StdioServerParameters`` (stderr into ``stderr``), streamable HTTP for a URL."""
    if isinstance(target, str):
        from mcp.client.streamable_http import streamable_http_client

        async with streamable_http_client(target) as (read_stream, write_stream):
            yield EndWatchingStream(read_stream, on_end), write_stream
        return
    async with stdio_transport(target, stderr, grace_s) as (read_stream, write_stream):
        yield EndWatchingStream(read_stream, on_end), write_stream


@asynccontextmanager
async def stdio_transport(
    params: Any, stderr: StderrTail | None, grace_s: Callable[[], float]
) -> AsyncIterator[tuple[Any, Any]]:
    """Newline-delimited JSON-RPC over a subprocess's stdin/stdout, with a shutdown a cancellation cannot skip.

    Written here rather than taken from ``mcp.client.stdio`` because that one keeps the process to
    itself and stops it with awaits only: a server stopped mid-way (SIGSTOP, a wedged process) and a
    task cancelled during that shutdown (``asyncio.run`` cancelling every task at its end) leave the
    server alive and the shutdown waiting forever. Here the last step is a synchronous SIGKILL to the
    server's process group. ``grace_s()`` is read at shutdown: the time a server gets to exit on EOF.
    """
    import mcp_types
    from mcp.client.stdio import get_default_environment
    from mcp.shared.message import SessionMessage

    process = await anyio.open_process(
        [params.command, *params.args],
        env=get_default_environment() | (params.env or {}),
        stderr=stderr.writer if stderr else None,
        cwd=params.cwd,
        start_new_session=True,  # its own process group: the kill reaches whatever it started
    )
    to_session, from_server = anyio.create_memory_object_stream(0)
    to_server, from_session = anyio.create_memory_object_stream(0)

    async def read_stdout() -> None:
        buffered = b""
        async with to_session:
            with suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                async for chunk in process.stdout:
                    *lines, buffered = (buffered + chunk).split(b"\n")
                    for line in filter(bytes.strip, lines):
                        try:
                            item: Any = SessionMessage(
                                mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                            )
                        except ValueError as error:  # the session reports a malformed message as an error
                            item = error
                        await to_session.send(item)

    async def write_stdin() -> None:
        async with from_session:
            try:
                async for message in from_session:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                await to_session.aclose()  # the server stopped reading: end the session rather than hang it

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read_stdout)
            tasks.start_soon(write_stdin)
            try:
                yield from_server, to_server
            finally:
                tasks.cancel_scope.cancel()
    finally:
        await _stop(process, grace_s())


async def _stop(process: Any, grace_s: float) -> None:
    """Close stdin and give the server ``grace_s`` to exit (MCP's shutdown), then SIGKILL its process group."""
    try:
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s):
            with suppress(Exception):
                await process.stdin.aclose()
            while process.returncode is None:
                await anyio.sleep(0.01)
    finally:
        if process.returncode is None:  # synchronous: runs even when a cancellation broke the wait above
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0), suppress(Exception):
            await process.aclose()  # reaps it: no zombie
