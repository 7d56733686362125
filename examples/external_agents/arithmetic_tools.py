"""The arithmetic task's two tools as an agent program implements them itself: plain functions, no agentloop API."""

from __future__ import annotations

from typing import Any

from agentloop.tasks.arithmetic.tools import evaluate

# the schemas of config/tools/arithmetic.yaml, so the model sees the prompt its warm start was trained on
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit_answer",
            "description": "Submit the final numeric answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "number"}}, "required": ["answer"]},
        },
    },
]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    try:
        return str(evaluate(expression))
    except (ValueError, ZeroDivisionError, TypeError) as error:
        return f"Error: {error}"


def is_correct(answer: Any, truth: Any) -> bool:
    """Whether a submitted answer is the ground truth."""
    try:
        return abs(float(answer) - float(truth)) < 1e-6
    except (TypeError, ValueError):
        return False
