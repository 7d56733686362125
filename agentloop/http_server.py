"""uvicorn on the running event loop, on a port of its own choosing if asked: what the rollout servers' HTTP fronts,
the session gateway and the trajectory viewer all serve with. Imports nothing heavy: the viewer starts without torch."""

from __future__ import annotations

import asyncio
import socket
import time

import uvicorn
from starlette.types import ASGIApp


async def serve(app: ASGIApp, host: str, port: int, timeout_s: float = 30.0) -> tuple[uvicorn.Server, int]:
    """Start uvicorn on the running loop (port 0: any free port); return the server and its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: a response written in two parts (headers, body) would otherwise
    # wait for the client's delayed ACK, about 40 ms per request
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, proxy_headers=False, lifespan="off")
    )
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
