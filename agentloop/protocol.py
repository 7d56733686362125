"""Records that cross process boundaries: what an engine returns and what an agent loop returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Why one engine call stopped.
FinishReason = Literal["stop", "length", "abort"]

# Why a trajectory ended, in every loop: ``stop`` the model answered and nothing continues the
# conversation; ``done`` the environment ended the episode; ``length`` the next turn or observation
# would not fit in rollout.response_length; ``max_turns`` a turn limit; ``tool_error_budget`` too many
# failed tool calls; ``env_error`` an env step kept failing; ``aborted`` the engine aborted the request.
EndReason = Literal["stop", "done", "length", "max_turns", "tool_error_budget", "env_error", "aborted"]


def end_after(finish_reason: FinishReason) -> EndReason | None:
    """The end a model turn forces on its trajectory: an aborted or length-capped turn ends it, a stop does not."""
    return {"abort": "aborted", "length": "length"}.get(finish_reason)

# Sampling keys every engine accepts; anything else is rejected so a typo never silently samples wrong.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "stop_token_ids": None,
    "ignore_eos": False,
}


def validate_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and reject unknown keys or out-of-range values, naming the valid ones."""
    unknown = sorted(set(params) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown sampling parameter(s) {unknown}; valid keys are {sorted(SAMPLING_DEFAULTS)}"
        )
    merged = {**SAMPLING_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    if int(merged["max_new_tokens"]) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {merged['max_new_tokens']}")
    if float(merged["temperature"]) < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {merged['temperature']}")
    if not 0 < float(merged["top_p"]) <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {merged['top_p']}")
    if int(merged["top_k"]) == 0 or int(merged["top_k"]) < -1:
        raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {merged['top_k']}")
    return merged


@dataclass
class TokenOutput:
    """One engine call's result: the sampled ids exactly as produced, with their logprobs.

    ``log_probs[i]`` is the log-probability of ``token_ids[i]`` under the distribution the sampler drew
    from (logits divided by temperature, after top-k/top-p filtering when those are active).
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    cached_tokens: int = 0


@dataclass
class AgentLoopOutput:
    """One finished trajectory, ready to be padded into the trainer's batch.

    ``response_mask`` is 1 on tokens the model produced and 0 on observation tokens (tool results,
    user turns); ``response_logprobs`` is the engine's logprob on model tokens and 0.0 elsewhere.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int = 2
    reward_score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lengths = {len(self.response_ids), len(self.response_mask), len(self.response_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                "AgentLoopOutput: response_ids, response_mask and response_logprobs must have the same "
                f"length, got {len(self.response_ids)}, {len(self.response_mask)}, {len(self.response_logprobs)}"
            )
