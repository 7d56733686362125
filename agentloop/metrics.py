"""Per-step aggregates of what the trajectories report: turns, end reasons, retries, errors, scores."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np


def turn_metrics(num_turns: np.ndarray, extra_fields: np.ndarray) -> dict[str, Any]:
    """Aggregate a batch's per-trajectory fields into ``meta_info`` entries."""
    turns = np.asarray(num_turns, dtype=float)
    metrics: dict[str, Any] = {
        "multi_turn/num_turns_min": float(turns.min()),
        "multi_turn/num_turns_mean": float(turns.mean()),
        "multi_turn/num_turns_max": float(turns.max()),
        "multi_turn/num_turns_histogram": dict(sorted(Counter(int(t) for t in turns).items())),
    }
    reasons: Counter[str] = Counter()
    counted: dict[str, Counter[str]] = {"env_retries": Counter(), "tool_errors": Counter()}
    scores_by_turn: dict[int, list[float]] = defaultdict(list)
    for extra in extra_fields:
        reasons[extra.get("finish_reason", "unknown")] += 1
        for key, counter in counted.items():
            counter.update(extra.get(key) or {})
        for turn, score in enumerate(extra.get("turn_scores") or []):
            scores_by_turn[turn].append(score)
    metrics.update({f"multi_turn/finish_reason/{reason}": count for reason, count in sorted(reasons.items())})
    for key, counter in counted.items():
        metrics.update({f"multi_turn/{key}/{kind}": count for kind, count in sorted(counter.items())})
    metrics.update(
        {f"multi_turn/interaction_score/turn_{turn}": float(np.mean(s)) for turn, s in sorted(scores_by_turn.items())}
    )
    return metrics
