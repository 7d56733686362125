"""MCP tool calls: a long-lived supervised session against a fresh session per call (the old way).

    python -m benchmarks.mcp_sessions [--calls 10] [--repeats 3]

The server is a real third-party stdio MCP server, PyPI ``mcp-server-time`` (``python -m
mcp_server_time``; ``pip install mcp-server-time``), and the call ``get_current_time`` for UTC. Two ways:
(a) the baseline, implemented here as agentloop did it before: every call opens its own ``mcp.Client``
over stdio (a process start, the handshake, the call, the shutdown); (b) ``MCPSession``, the
long-lived session MCP tools now use (one process, started once before timing). For each, the p50 of
``--calls`` sequential calls and the wall time of 8 parallel calls; (a) and (b) alternate per repeat
and the ratios are medians over repeats. Ratios within one run only: absolute times vary here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp import Client, StdioServerParameters

from agentloop.tools.mcp_session import MCPSession

SERVER = StdioServerParameters(command=sys.executable, args=["-m", "mcp_server_time", "--local-timezone", "UTC"])
TOOL, ARGUMENTS = "get_current_time", {"timezone": "UTC"}


async def fresh_session_call() -> Any:
    """The baseline: a session (for stdio: a server process) per call."""
    async with Client(SERVER, read_timeout_seconds=30) as client:
        return await client.call_tool(TOOL, ARGUMENTS)


async def measure(call: Callable[[], Awaitable[Any]], calls: int) -> tuple[float, float]:
    """(p50 of ``calls`` sequential calls, wall time of 8 parallel calls), in seconds."""
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        result = await call()
        latencies.append(time.perf_counter() - start)
        assert not result.is_error, result
    start = time.perf_counter()
    results = await asyncio.gather(*(call() for _ in range(8)))
    parallel = time.perf_counter() - start
    assert not any(result.is_error for result in results)
    return statistics.median(latencies), parallel


async def main(calls: int, repeats: int) -> None:
    session = MCPSession("time", SERVER, timeout_s=30, max_concurrency=16)
    await session.call_tool(TOOL, ARGUMENTS)  # started once, as a worker's first call would
    rows = []
    for repeat in range(repeats):
        fresh = await measure(fresh_session_call, calls)
        long_lived = await measure(lambda: session.call_tool(TOOL, ARGUMENTS), calls * 10)
        rows.append((fresh, long_lived))
        print(
            f"repeat {repeat}: (a) fresh per call p50 {fresh[0] * 1e3:.1f} ms, 8 parallel {fresh[1] * 1e3:.0f} ms | "
            f"(b) long-lived p50 {long_lived[0] * 1e3:.2f} ms, 8 parallel {long_lived[1] * 1e3:.1f} ms"
        )
    await session.close()

    def median(pick: Callable[[tuple], float]) -> float:
        return statistics.median(pick(row) for row in rows)

    print(
        f"p50 sequential: (a) {median(lambda r: r[0][0]) * 1e3:.1f} ms, (b) {median(lambda r: r[1][0]) * 1e3:.2f} ms, "
        f"a/b {median(lambda r: r[0][0] / r[1][0]):.0f}"
    )
    print(
        f"8 parallel:     (a) {median(lambda r: r[0][1]) * 1e3:.0f} ms, (b) {median(lambda r: r[1][1]) * 1e3:.1f} ms, "
        f"a/b {median(lambda r: r[0][1] / r[1][1]):.0f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--calls", type=int, default=10, help="sequential calls per repeat for (a); (b) makes 10x as many"
    )
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.calls, arguments.repeats))
