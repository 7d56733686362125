"""Which policy version generated each model token of a sample, kept per session as ``VersionRuns``
(``agentloop.policy_versions``): a session whose sample is never taken costs a few runs until evicted, not one
entry per token."""

from __future__ import annotations

from cachetools import LRUCache

from agentloop.policy_versions import VersionRuns


class VersionBook:
    """Token versions per session, taken per sample: a sample's loop may generate under its own request id or
    under ids of its own (verl's loops do), which then count as the sample's, in the order they began."""

    def __init__(self, max_sessions: int) -> None:
        self.runs: LRUCache[str, VersionRuns] = LRUCache(maxsize=max_sessions)  # session -> version runs
        self.sessions_of: LRUCache[str, list[str]] = LRUCache(maxsize=max_sessions)  # sample -> sessions it began

    def begin(self, session: str, sample: str | None) -> VersionRuns:
        """The version runs of ``session``, one of ``sample``'s sessions (None: no sample is running), to add a
        turn's runs to once it ends; a session the sample begins counts as its own from now on."""
        if sample not in (None, session) and session not in self.runs:
            self.sessions_of.setdefault(sample, []).append(session)
        return self.runs.setdefault(session, VersionRuns())

    def take(self, sample: str) -> list[int]:
        """The policy version of each token generated for ``sample`` so far, in order; forgets them. Those of its
        own session if its loop generated under its id, else those of the sessions it began, one after the other.
        Either way the sessions it began are forgotten with it."""
        own = self.runs.pop(sample, None)
        others = [self.runs.pop(session, VersionRuns()) for session in self.sessions_of.pop(sample, [])]
        if own is None:
            own = VersionRuns()
            for session in others:
                own.extend(session)
        return own.per_token()
