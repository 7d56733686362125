"""Built-in scorers for verl's common data sources, chosen by a row's ``data_source`` as verl chooses them.

``default_compute_score(data_source, solution_str, ground_truth, extra_info)`` is what scores a sample
when the config names no reward function for its data source (``custom_reward_function``). The
scorers are written here; they give the same scores as verl's for the same text.
"""

from __future__ import annotations

from typing import Any, Callable

from agentloop.reward_score import gsm8k, math_reward

# data_source -> scorer(solution_str, ground_truth)
SCORERS: dict[str, Callable[[str, Any], float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_reward.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_reward.compute_score,
    "HuggingFaceH4/MATH-500": math_reward.compute_score,
}


def has_scorer(data_source: str | None) -> bool:
    """Whether a built-in scorer handles this data source."""
    return data_source in SCORERS


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    """Score ``solution_str`` with the built-in scorer for ``data_source``."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r} (built-in: {sorted(SCORERS)}); name your "
            "function with custom_reward_function.path and .name, or custom_reward_function.by_data_source"
        )
    return float(scorer(solution_str, ground_truth))
