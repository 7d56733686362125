"""Per-request latency of a rollout server's HTTP front, against the same request written in one packet.

    python -m benchmarks.http_latency [--requests 50]

One ``hf`` server with ``rollout.http`` on 127.0.0.1. (a) ``requests`` on a keep-alive session:
``GET /health`` and ``POST /abort_request`` of an unknown id (404, no engine work); (b) the same POST
written by hand in one packet on a fresh connection. Prints the mean milliseconds of each and a/b.
"""

from __future__ import annotations

import argparse
import socket
import time

import ray
import requests

from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare


def mean_ms(call, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        call()
    return 1000 * (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    manager = AgentLoopManager(prepare(compose_config([])))
    try:
        url = manager.server_addresses[0]
        host, port = url.split("//")[1].rsplit(":", 1)
        session = requests.Session()
        body = b'{"rid": "unknown"}'
        packet = (
            b"POST /abort_request HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        ) + body

        def by_hand() -> None:
            with socket.create_connection((host, int(port))) as connection:
                connection.sendall(packet)
                while connection.recv(65536):
                    pass

        health = mean_ms(lambda: session.get(url + "/health"), args.requests)
        post = mean_ms(lambda: session.post(url + "/abort_request", json={"rid": "unknown"}), args.requests)
        raw = mean_ms(by_hand, args.requests)
    finally:
        manager.shutdown()
    print(
        f"(a) GET /health {health:.2f} ms, POST /abort_request {post:.2f} ms; (b) one packet by hand {raw:.2f} ms; "
        f"a/b {post / raw:.1f}"
    )


if __name__ == "__main__":
    main()
