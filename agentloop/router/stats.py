"""What the router counted since its stats were last taken, per worker, merged by the manager."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterStats:
    """Counters since the last reset: per-server dispatches and the in-flight balance seen at dispatch."""

    requests_per_server: list[int]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    interrupted_requests: int = 0  # turns that new weights interrupted and the router continued
    rehomed_requests: int = 0  # turns moved off a server that died or stopped answering its probes
    server_calls: int = 0  # Ray calls that carried them (a burst of turns goes to a server in one)
    # max/mean of in-flight counts sampled at every dispatch made while all live servers were busy
    imbalance_samples: list[float] = field(default_factory=list)
    # ranks the router takes for dead when the stats are taken (gone, or not answering its probes)
    unhealthy_ranks: list[int] = field(default_factory=list)

    @classmethod
    def merge(cls, parts: list[RouterStats]) -> RouterStats:
        """The counters of several routers over the same servers (one router per worker), added up."""
        return cls(
            requests_per_server=[sum(counts) for counts in zip(*(part.requests_per_server for part in parts))],
            prompt_tokens=sum(part.prompt_tokens for part in parts),
            cached_tokens=sum(part.cached_tokens for part in parts),
            interrupted_requests=sum(part.interrupted_requests for part in parts),
            rehomed_requests=sum(part.rehomed_requests for part in parts),
            server_calls=sum(part.server_calls for part in parts),
            imbalance_samples=[sample for part in parts for sample in part.imbalance_samples],
            unhealthy_ranks=sorted({rank for part in parts for rank in part.unhealthy_ranks}),
        )

    @property
    def cached_token_share(self) -> float:
        """Share of prompt tokens the servers took from their prefix caches."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_call(self) -> float:
        """Requests per Ray call to the servers (1.0: every request was a call of its own)."""
        return sum(self.requests_per_server) / self.server_calls if self.server_calls else 0.0

    @property
    def in_flight_imbalance(self) -> float:
        """Mean over busy dispatches of max/mean in-flight requests per server (1.0: perfectly even)."""
        return sum(self.imbalance_samples) / len(self.imbalance_samples) if self.imbalance_samples else 1.0
