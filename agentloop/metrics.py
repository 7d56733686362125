"""Per-step aggregates of a rollout batch: timings, router balance and cache hits, turns, end reasons."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from agentloop.batch import RolloutBatch
from agentloop.router import RouterStats


def rollout_metrics(batch: RolloutBatch, stats: RouterStats, elapsed_s: float) -> dict[str, Any]:
    """The ``meta_info`` of a finished batch: what its trajectories and the routers report."""
    times = batch.non_tensor_batch["generate_time_s"].astype(float)
    return {
        "timing/generate_sequences_s": elapsed_s,
        "timing/trajectory_min_s": float(times.min()),
        "timing/trajectory_mean_s": float(times.mean()),
        "timing/trajectory_max_s": float(times.max()),
        "rollout/requests_per_server": stats.requests_per_server,
        "rollout/cached_token_share": stats.cached_token_share,
        "rollout/in_flight_imbalance": stats.in_flight_imbalance,
        "rollout/response_tokens": int(batch.batch["response_mask"].sum()),
        **turn_metrics(batch.non_tensor_batch["num_turns"], batch.non_tensor_batch["extra_fields"]),
    }


def turn_metrics(num_turns: np.ndarray, extra_fields: np.ndarray) -> dict[str, Any]:
    """Aggregate a batch's per-trajectory fields: turns, end reasons, retries and errors by kind, scores."""
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
