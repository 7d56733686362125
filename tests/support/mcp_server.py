"""A stdio MCP server for the MCP tool tests: arithmetic, failures, and tools that report or break the process.

Run as a script (``python tests/support/mcp_server.py``); it imports nothing from the project.
"""

from __future__ import annotations

import json
import os
import signal

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("arith")
in_flight = {"now": 0, "peak": 0}  # calls of `slow` running at once, to check the client's concurrency bound


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(reason)


@server.tool()
def pid() -> int:
    """The server's process id (tests check that calls share one process)."""
    return os.getpid()


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep without blocking the server; return the pid and the most `slow` calls seen running at once."""
    in_flight["now"] += 1
    in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
    try:
        await anyio.sleep(seconds)
    finally:
        in_flight["now"] -= 1
    return json.dumps({"pid": os.getpid(), "peak": in_flight["peak"]})


@server.tool()
def freeze() -> str:
    """Stop the whole process (SIGSTOP): a server that hangs and answers nothing, pings included."""
    os.kill(os.getpid(), signal.SIGSTOP)
    return "unreachable"


if __name__ == "__main__":
    server.run()
