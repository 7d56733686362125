"""Per-step aggregates of a rollout batch: timings, router balance and cache hits, turns, tool calls, end reasons.

Named as verl names them where verl has a name (``num_turns/*``, ``tool_call_counts/*``,
``timing_s/agent_loop/*``); the rest under ``rollout/``, ``multi_turn/`` and ``judge/``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from agentloop.batch import RolloutBatch, trajectory_sizes
from agentloop.turn_totals import env_retries_by_kind, tool_errors_by_kind, turn_scores
from agentloop.router import RouterStats


def rollout_metrics(batch: RolloutBatch, stats: RouterStats, elapsed_s: float) -> dict[str, Any]:
    """The ``meta_info`` of a finished batch: what its trajectories (one row each: their last segment's) and the
    routers report."""
    last = batch.last_segments()
    fields = {key: column[last] for key, column in batch.non_tensor_batch.items()}
    tool_seconds = [sum(turn.tool_latency_s for turn in turns) for turns in fields["turns"]]
    return {
        "timing_s/generate_sequences": elapsed_s,
        **spread("timing_s/agent_loop/generate_sequences", fields["generate_time_s"]),
        **spread("timing_s/agent_loop/tool_calls", tool_seconds),
        "rollout/requests_per_server": stats.requests_per_server,
        "rollout/cached_token_share": stats.cached_token_share,
        "rollout/in_flight_imbalance": stats.in_flight_imbalance,
        "rollout/interrupted_requests": stats.interrupted_requests,
        "rollout/rehomed_requests": stats.rehomed_requests,
        "rollout/requests_per_call": stats.requests_per_call,
        "rollout/response_tokens": int(batch.batch["response_mask"].sum()),
        "rollout/failed_samples": sum(failure is not None for failure in fields["failure"]),
        **spread("rollout/segments_per_trajectory", trajectory_sizes(batch.batch["segment_index"])),
        **turn_metrics(fields["num_turns"], fields["end_reason"], fields["turns"]),
        **judge_metrics(fields["judge_calls"]),
    }


def judge_metrics(judge_calls: np.ndarray) -> dict[str, Any]:
    """The judge's calls of a batch (``agentloop.judge.JudgeCall`` lists, one per trajectory): how many, their tokens,
    latency and failures; nothing when the judge was not called."""
    calls = [call for record in judge_calls for call in record]
    if not calls:
        return {}
    return {
        "judge/calls": len(calls),
        "judge/prompt_tokens": sum(call.prompt_tokens for call in calls),
        "judge/response_tokens": sum(call.response_tokens for call in calls),
        **spread("judge/latency_s", [call.latency_s for call in calls]),
        "judge/failures": sum(call.error is not None for call in calls),
    }


def turn_metrics(num_turns: np.ndarray, end_reasons: np.ndarray, turns: np.ndarray) -> dict[str, Any]:
    """Aggregate a batch's per-trajectory records: turns, tool calls, end reasons (None: ``unknown``), retries and
    errors by kind, interaction scores."""
    calls = [sum(turn.tool_calls for turn in record) for record in turns]
    metrics: dict[str, Any] = {
        **spread("num_turns", num_turns),
        "multi_turn/num_turns_histogram": dict(sorted(Counter(int(t) for t in num_turns).items())),
        **spread("tool_call_counts", calls),
    }
    reasons = Counter(reason or "unknown" for reason in end_reasons)
    counted: dict[str, Counter[str]] = {"env_retries": Counter(), "tool_errors": Counter()}
    scores_by_turn: dict[int, list[float]] = defaultdict(list)
    for record in turns:
        counted["env_retries"].update(env_retries_by_kind(record))
        counted["tool_errors"].update(tool_errors_by_kind(record))
        for turn, score in enumerate(turn_scores(record)):
            scores_by_turn[turn].append(score)
    metrics.update({f"multi_turn/finish_reason/{reason}": count for reason, count in sorted(reasons.items())})
    for key, counter in counted.items():
        metrics.update({f"multi_turn/{key}/{kind}": count for kind, count in sorted(counter.items())})
    # calls the model made: those run plus those dropped past max_parallel_calls (each counted as an error)
    made = sum(calls) + sum(turn.dropped_calls for record in turns for turn in record)
    metrics["multi_turn/tool_error_rate"] = sum(counted["tool_errors"].values()) / made if made else 0.0
    metrics.update(
        {f"multi_turn/interaction_score/turn_{turn}": float(np.mean(s)) for turn, s in sorted(scores_by_turn.items())}
    )
    return metrics


def spread(name: str, values: Any) -> dict[str, float]:
    """``name/min``, ``/mean`` and ``/max`` of an array (0.0 each when it is empty), as verl logs them."""
    array = np.asarray(values, dtype=float)
    if not array.size:
        return {f"{name}/{stat}": 0.0 for stat in ("min", "mean", "max")}
    return {f"{name}/min": float(array.min()), f"{name}/mean": float(array.mean()), f"{name}/max": float(array.max())}
