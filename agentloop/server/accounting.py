"""What a server of either pool (a ``RolloutServer``, a judge's ``RewardModelServer``) reports of itself: where it runs
and how long it has been busy."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any, Iterator

import ray


def node_info(rank: int) -> dict[str, Any]:
    """Where the calling server runs: its rank, Ray node id, host name and process id."""
    return {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }


class BusyClock:
    """Seconds so far with at least one request in progress: the trainer's measure of a server's idle time per step."""

    def __init__(self) -> None:
        self.active, self._total, self._since = 0, 0.0, 0.0  # active: requests in progress now

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Around one request."""
        self.active += 1
        if self.active == 1:
            self._since = time.perf_counter()
        try:
            yield
        finally:
            self.active -= 1
            if not self.active:
                self._total += time.perf_counter() - self._since

    def seconds(self) -> float:
        return self._total + (time.perf_counter() - self._since if self.active else 0.0)
