"""What a trajectory's turns add up to, by kind: the per-sample totals the step's metrics (``agentloop.metrics``) and
the rollout dumps (``agentloop.dumps``) report."""

from __future__ import annotations

from collections import Counter

from agentloop.protocol import TurnRecord


def tool_errors_by_kind(turns: list[TurnRecord]) -> dict[str, int]:
    """How many of these turns' tool calls failed, by kind."""
    return dict(Counter(call.error for turn in turns for call in turn.calls if call.error is not None))


def env_retries_by_kind(turns: list[TurnRecord]) -> dict[str, int]:
    """How many of these turns' env steps failed, by kind."""
    return dict(sum((Counter(turn.env_retries) for turn in turns), Counter()))


def turn_scores(turns: list[TurnRecord]) -> list[float]:
    """The interaction's score of each turn it answered, in order."""
    return [turn.interaction_score for turn in turns if turn.interaction_score is not None]
