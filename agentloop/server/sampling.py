"""What every engine checks of a request before it samples (sampling params, prompt) and how it names a call that was
cut short; the engines and their HTTP fronts share them."""

from __future__ import annotations

import math
import numbers
from typing import Any

from agentloop.protocol import FinishReason


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
    """Fill defaults and reject unknown keys, wrong types or out-of-range values, naming the valid ones."""
    if not isinstance(params, dict):
        raise ValueError(f"sampling params must be a mapping, got {type(params).__name__}")
    unknown = sorted(set(params) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; valid keys are {sorted(SAMPLING_DEFAULTS)}")
    merged = {**SAMPLING_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    for key in ("max_new_tokens", "top_k"):
        merged[key] = _number(merged, key, int)
    for key in ("temperature", "top_p"):
        merged[key] = _number(merged, key, float)
    if merged["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {merged['max_new_tokens']}")
    if not 0 <= merged["temperature"] < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {merged['temperature']}")
    if not 0 < merged["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {merged['top_p']}")
    if merged["top_k"] == 0 or merged["top_k"] < -1:
        raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {merged['top_k']}")
    stop = merged["stop_token_ids"]
    if stop is not None and not (isinstance(stop, list) and all(_is_int(token) for token in stop)):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {stop!r}")
    if not isinstance(merged["ignore_eos"], bool):
        raise ValueError(f"ignore_eos must be true or false, got {merged['ignore_eos']!r}")
    return merged


def validate_prompt(prompt_ids: Any, max_new_tokens: int, vocab_size: int, max_model_len: int) -> list[int]:
    """Reject a prompt an engine must never see: empty, not token ids, ids outside the vocabulary, or too long
    to generate ``max_new_tokens`` after it within ``max_model_len`` tokens. One bad request fails alone."""
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise ValueError(
            "prompt_ids is empty" if isinstance(prompt_ids, (list, tuple)) else "prompt_ids must be a list of token ids"
        )
    # plain ints first: the check against numbers.Integral costs more per token than the rest of a request
    if not all(type(token) is int for token in prompt_ids) and not all(_is_int(token) for token in prompt_ids):
        raise ValueError("prompt_ids must be a list of integer token ids")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        outside = [token for token in prompt_ids if not 0 <= token < vocab_size]
        raise ValueError(f"token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) + max_new_tokens > max_model_len:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds this engine's "
            f"limit of {max_model_len} tokens; shorten the prompt or lower max_new_tokens"
        )
    return list(prompt_ids)


def id_list(value: int | list[int] | None) -> list[int]:
    """A config's token id field (one id, a list of them, or none) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(params: dict[str, Any], key: str, kind: type) -> Any:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (kind is int and value != int(value)):
        raise ValueError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def finish_reason_of(
    tokens: list[int], stop_ids: list[int], max_new_tokens: int, otherwise: FinishReason
) -> FinishReason:
    """Why a call that was cut short (aborted, interrupted) ended: ``stop`` if its last token is one of
    ``stop_ids``, ``length`` if it has ``max_new_tokens``, else ``otherwise``. A call cut right after the token
    that ended it is over: it must not be continued past its stop token or its budget."""
    if tokens and tokens[-1] in stop_ids:
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else otherwise
