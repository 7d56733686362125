"""Where a session's requests go: the live server with the fewest requests in flight for a new session, the
same server for its later turns (its prefix cache holds the conversation so far), and its GRPO group's server
while that one is not much busier (the group's shared prompt is prefilled there once)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import ray
from cachetools import LRUCache


@dataclass(eq=False)
class ServerSlot:
    """One rollout server as the router counts it. A replacement server gets a new slot: a request still waiting
    on its predecessor settles on the old slot, so it can neither lower the new server's count nor mark it dead."""

    rank: int
    handle: ray.actor.ActorHandle
    alive: bool = True
    waiting: set[asyncio.Future] = field(default_factory=set)  # the answers of the requests in flight on it
    watcher: asyncio.Task | None = None  # the router's probes of it (``Router._watch``)

    @property
    def in_flight(self) -> int:
        return len(self.waiting)


class Placement:
    """The rank each session is pinned to, chosen least in flight with sticky sessions and group affinity."""

    def __init__(
        self,
        servers: list[ray.actor.ActorHandle],
        max_sessions: int,
        group_affinity_slack: int | None,
        role: str = "rollout server",
    ) -> None:
        self.slots = [ServerSlot(rank, handle) for rank, handle in enumerate(servers)]
        self.role = role  # what the servers are called in errors
        self.group_affinity_slack = group_affinity_slack  # None: no affinity
        self.sessions: LRUCache[str, int] = LRUCache(maxsize=max_sessions)  # session -> rank
        self.group_home: LRUCache[str, int] = LRUCache(maxsize=max_sessions)  # group -> its first session's rank

    def rank_of(self, session: str) -> int | None:
        """The rank ``session`` is pinned to (None: not placed yet)."""
        return self.sessions.get(session)

    def place(self, session: str, group: str | None) -> ServerSlot:
        """The slot for the next request of ``session``: its pinned server while that one lives, else a new home
        (pinned from now on), which becomes ``group``'s home when the group has none yet."""
        rank = self.sessions.get(session)
        if rank is not None and self.slots[rank].alive:
            return self.slots[rank]
        live = [slot for slot in self.slots if slot.alive]
        if not live:
            raise RuntimeError(f"every {self.role} has died; no request can be served")
        slot = min(live, key=lambda candidate: candidate.in_flight)
        if group is not None and self.group_affinity_slack is not None:
            home = self.group_home.get(group)
            if (
                home is not None
                and self.slots[home].alive
                and self.slots[home].in_flight - slot.in_flight <= self.group_affinity_slack
            ):
                slot = self.slots[home]
            else:
                self.group_home[group] = slot.rank
        self.sessions[session] = slot.rank
        return slot

    def replace(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """A new server for ``rank`` (its predecessor died): a fresh slot; the rank's sessions stay pinned to it."""
        self.slots[rank] = ServerSlot(rank, server)

    def imbalance(self) -> float | None:
        """max/mean of the live servers' in-flight counts, or None while some live server is idle."""
        counts = [slot.in_flight for slot in self.slots if slot.alive]
        return max(counts) * len(counts) / sum(counts) if counts and min(counts) > 0 else None
