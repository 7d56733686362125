"""One long-lived, supervised MCP session per server and event loop.

``MCPConnection`` is one server process (or HTTP connection): a single owner task opens the ``mcp``
``Client`` (the transport and session are anyio contexts that must be entered and left by the same
task), publishes it, and waits until the connection is retired; then, still in that task, it leaves
the contexts, which shuts the server down (stdin closed, SIGTERM, SIGKILL to its process group).

``MCPSession`` serves calls from any task of the loop straight on the published client (the JSON-RPC
dispatcher matches concurrent requests by id), at most ``max_concurrency`` at a time, and supervises:

- death: the server's output ends (its process exited) -> the connection is retired at once, the calls
  in flight fail with the cause and the server's stderr tail, the next call starts a new process;
- hang: a call times out (or is cancelled by the caller's timeout) -> a bounded probe checks the server
  (tools/list, which every tool server answers; ping is legacy-only since MCP 2026-07-28); no answer ->
  retired as above (the calls in flight fail), a server that answers keeps serving;
- restarts: a failed start backs off exponentially, and starts within a minute are capped, so a
  crashing server costs the calls fast errors instead of a process start each.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from typing import Any

from agentloop.tools.mcp_transport import StderrTail, watched_transport

_CLOSED = "the session was closed"
_LOOP_ENDED = "the worker's event loop shut down"


class MCPServerUnavailable(RuntimeError):
    """The server cannot serve calls now (it failed to start, or restarts are backing off)."""


class MCPServerLost(RuntimeError):
    """The server died or stopped answering while the call was in flight."""


class RestartPolicy:
    """Backoff after failed starts and a cap on starts per minute."""

    def __init__(self, max_starts_per_minute: int, base_backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        self.max_starts_per_minute = max_starts_per_minute
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._starts: collections.deque[float] = collections.deque()
        self._consecutive_failures = 0
        self._retry_at = 0.0
        self.last_failure = ""

    def admit(self, server: str) -> None:
        """Record a start, or raise ``MCPServerUnavailable`` while backing off or over the budget."""
        now = time.monotonic()
        if now < self._retry_at:
            raise MCPServerUnavailable(
                f"MCP server {server!r} failed to start {self._consecutive_failures} time(s) in a row "
                f"(last: {self.last_failure}); next attempt in {self._retry_at - now:.1f}s"
            )
        while self._starts and now - self._starts[0] > 60.0:
            self._starts.popleft()
        if len(self._starts) >= self.max_starts_per_minute:
            raise MCPServerUnavailable(
                f"MCP server {server!r} was started {len(self._starts)} times in the last minute, the budget; "
                f"next attempt in {60.0 - (now - self._starts[0]):.1f}s (last failure: {self.last_failure or 'none'})"
            )
        self._starts.append(now)

    def started(self) -> None:
        self._consecutive_failures = 0

    def failed(self, cause: str) -> None:
        self._consecutive_failures += 1
        self.last_failure = cause
        backoff = min(self.max_backoff_s, self.base_backoff_s * 2 ** (self._consecutive_failures - 1))
        self._retry_at = time.monotonic() + backoff


class MCPConnection:
    """One server process (or HTTP connection), owned by one task from opening to shutdown."""

    def __init__(self, server: str, target: Any, handshake_timeout_s: float) -> None:
        self.server = server
        self.cause: str | None = None  # why it was retired; None while serving
        self.client: Any = None
        self.stderr = None if isinstance(target, str) else StderrTail()
        self._closing = asyncio.Event()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.task = asyncio.get_running_loop().create_task(
            self._own(target, handshake_timeout_s), name=f"mcp-session-{server}"
        )

    @property
    def retired(self) -> bool:
        return self._closing.is_set()

    def retire(self, cause: str) -> None:
        """Stop taking calls; the owner task shuts the server down (the first cause is the one reported)."""
        if self.cause is None:
            self.cause = cause
        self._closing.set()

    def describe_cause(self) -> str:
        tail = self.stderr.text()[-800:] if self.stderr else ""
        return f"{self.cause or 'the connection closed'}" + (f"; server stderr: {tail}" if tail else "")

    async def _own(self, target: Any, handshake_timeout_s: float) -> None:
        from mcp import Client

        cancelled = False
        try:
            # read_timeout_seconds bounds the handshake and probes; calls pass their own timeout.
            transport = watched_transport(
                target, self.stderr, lambda: self.retire("its process exited (its output ended)"), self._grace_s
            )
            async with Client(transport, read_timeout_seconds=handshake_timeout_s) as client:
                self._close_stderr_writer()
                self.client = client
                self.ready.set_result(client)
                try:
                    await self._closing.wait()
                except asyncio.CancelledError:
                    # The loop is shutting down (asyncio.run cancels every task). Leave the contexts
                    # without a pending cancellation so their bounded shutdown kills the server.
                    asyncio.current_task().uncancel()
                    cancelled = True
                    self.retire(_LOOP_ENDED)
        except asyncio.CancelledError:
            self.retire(_LOOP_ENDED)
            raise
        except Exception as error:  # noqa: BLE001 -- a failed start or a broken transport; reported to callers
            self.retire(_describe(error))
        finally:
            self._close_stderr_writer()
            if not self.ready.done():
                self.ready.set_exception(
                    MCPServerUnavailable(f"MCP server {self.server!r} could not be started: {self.describe_cause()}")
                )
                self.ready.exception()  # retrieved here: a start nobody waits for must not warn at GC
        if cancelled:
            raise asyncio.CancelledError

    def _grace_s(self) -> float:
        """Seconds the server gets to exit on its own: none for one that died or hangs, 2 for a clean close."""
        return 2.0 if self.cause in (_CLOSED, _LOOP_ENDED) else 0.0

    def _close_stderr_writer(self) -> None:
        if self.stderr:
            self.stderr.close_writer()

    async def close(self) -> None:
        """Retire and wait for the shutdown (the server process is gone when this returns)."""
        self.retire(_CLOSED)
        await asyncio.shield(self.task)


def _describe(error: BaseException) -> str:
    """The innermost first error of an exception group (anyio task groups wrap transport failures)."""
    while getattr(error, "exceptions", None):  # duck-typed: BaseExceptionGroup is 3.11+
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


class MCPSession:
    """Calls to one MCP server from one event loop, on a connection restarted when it dies or hangs."""

    def __init__(
        self,
        server: str,
        target: Any,
        timeout_s: float,
        max_concurrency: int = 16,
        rate_limit: float | None = None,
        ping_timeout_s: float | None = None,
        max_starts_per_minute: int = 10,
    ) -> None:
        self.server = server
        self.target = target
        self.timeout_s = timeout_s
        self.ping_timeout_s = ping_timeout_s or min(5.0, timeout_s)
        self.policy = RestartPolicy(max_starts_per_minute)
        self.connection: MCPConnection | None = None
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._open_lock = asyncio.Lock()
        self._interval = 1.0 / rate_limit if rate_limit else 0.0
        self._next_slot = 0.0
        self._slot_lock = asyncio.Lock()
        self._probes: dict[MCPConnection, asyncio.Task] = {}

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """Call a tool; raises ``TimeoutError`` past ``timeout_s``, ``MCPServerLost``/``MCPServerUnavailable`` on faults."""
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        await self._wait_for_slot()
        async with self._semaphore:
            connection = await self._connect()
            try:
                return await connection.client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s)
            except MCPError as error:
                if error.code == CONNECTION_CLOSED:
                    connection.retire("the connection closed")  # no-op when the cause is already known
                    raise MCPServerLost(
                        f"MCP server {self.server!r} was lost during the call: {connection.describe_cause()}"
                    ) from None
                if error.code == REQUEST_TIMEOUT:
                    self._probe(connection)
                    raise TimeoutError(
                        f"MCP server {self.server!r}: {name} did not answer within {self.timeout_s:g}s"
                    ) from None
                raise  # the server's answer to this request (unknown tool, bad params): the call's fault
            except asyncio.CancelledError:
                self._probe(connection)  # usually the caller's own timeout: is the server still there?
                raise
            except Exception:
                self._probe(connection)  # a transport error (HTTP): the server may be gone
                raise

    async def _connect(self) -> MCPConnection:
        """The serving connection, started if there is none (one start at a time; waiting calls share it)."""
        async with self._open_lock:
            connection = self.connection
            if connection is None or connection.retired:
                self.policy.admit(self.server)
                connection = self.connection = MCPConnection(self.server, self.target, self.timeout_s)
                connection.ready.add_done_callback(functools.partial(self._record_start, connection))
        try:
            # The handshake is bounded by the client's read timeout; this bounds a server that never answers at all.
            await asyncio.wait_for(asyncio.shield(connection.ready), self.timeout_s + 5.0)
        except asyncio.TimeoutError:
            connection.retire(f"no handshake within {self.timeout_s + 5.0:g}s")
            connection.task.cancel()
            raise MCPServerUnavailable(
                f"MCP server {self.server!r} could not be started: {connection.describe_cause()}"
            ) from None
        if connection.retired:  # died between the handshake and this call
            raise MCPServerLost(
                f"MCP server {self.server!r} was lost before the call was sent: {connection.describe_cause()}"
            )
        return connection

    def _record_start(self, connection: MCPConnection, ready: asyncio.Future) -> None:
        if ready.cancelled() or ready.exception() is not None:
            self.policy.failed(connection.describe_cause())
        else:
            self.policy.started()

    def _probe(self, connection: MCPConnection) -> None:
        """Probe the server in the background; retire the connection if it does not answer in time."""
        if connection.retired or connection in self._probes:
            return
        self._probes[connection] = asyncio.get_running_loop().create_task(self._ping(connection))

    async def _ping(self, connection: MCPConnection) -> None:
        try:
            await asyncio.wait_for(connection.client.list_tools(cache_mode="refresh"), self.ping_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 -- any failure to answer means the server is not serving
            reason = "no answer" if isinstance(error, asyncio.TimeoutError) else f"{type(error).__name__}: {error}"
            connection.retire(
                f"it stopped answering (a tools/list probe after a timed-out call got {reason} within {self.ping_timeout_s:g}s)"
            )
        finally:
            self._probes.pop(connection, None)

    async def _wait_for_slot(self) -> None:
        """``rate_limit`` calls per second: each call takes the next free slot."""
        if not self._interval:
            return
        async with self._slot_lock:
            now = asyncio.get_running_loop().time()
            if self._next_slot > now:
                await asyncio.sleep(self._next_slot - now)
            self._next_slot = max(now, self._next_slot) + self._interval

    async def close(self) -> None:
        """Shut the server down (idempotent); the next call would start a new one."""
        for task in list(self._probes.values()):
            task.cancel()
        if self.connection is not None:
            await self.connection.close()
