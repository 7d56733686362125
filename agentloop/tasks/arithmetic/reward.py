"""The arithmetic task's reward function (``custom_reward_function``): the last number of the final answer."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def arithmetic_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    """1.0 when the last number in the final answer equals the ground truth, else 0.0."""
    numbers = _NUMBER.findall(solution_str)
    try:
        correct = bool(numbers) and abs(float(numbers[-1]) - float(ground_truth)) < 1e-6
    except (TypeError, ValueError):
        correct = False
    return {"score": float(correct), "answer_found": float(bool(numbers))}
