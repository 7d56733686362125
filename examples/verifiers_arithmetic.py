"""The quick start's arithmetic task as a verifiers environment package (``config/verifiers_grpo.yaml``): written
against ``verifiers``' public API only, as an environment on Prime Intellect's hub is, and trained unedited by
``verifiers_agent`` (``vf.load_environment("examples.verifiers_arithmetic", ...)``).

A ``StatefulToolEnv`` with a calculator and ``submit_answer`` (which hears the example's answer from the rollout's
state, hidden from the model); its rubric rewards a last submitted answer equal to the example's. Each example offers
the tool schemas the quick start's warm start was trained with (verifiers' per-example ``info.oai_tools``), so the
warm-started tiny model sees the prompt it knows.
"""

from __future__ import annotations

import json
import random
from typing import Any

import verifiers as vf
from datasets import Dataset

from examples.external_agents.arithmetic_tools import TOOLS, is_correct
from examples.external_agents.arithmetic_tools import calculator as evaluate

SYSTEM = "Use the calculator tool to compute, then call submit_answer with the result."


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 12 * (3 + 4)
    """
    return evaluate(expression)


def submit_answer(answer: float, truth: str) -> str:
    """Submit the final numeric answer.

    Args:
        answer: the answer
    """
    return "correct" if is_correct(answer, truth) else "incorrect"


class ArithmeticEnv(vf.StatefulToolEnv):
    """The arithmetic tools; ``submit_answer`` gets the example's answer from the state."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(tools=[calculator], **kwargs)
        self.add_tool(submit_answer, args_to_skip=["truth"])

    def update_tool_args(
        self, tool_name: str, tool_args: dict, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> dict:
        if tool_name == "submit_answer":
            tool_args["truth"] = state["answer"]
        return tool_args


def submitted_correct(completion: vf.Messages, answer: str) -> float:
    """1 when the last ``submit_answer`` call submitted the example's answer."""
    submitted = [
        call["function"]["arguments"]
        for message in completion
        if message["role"] == "assistant"
        for call in message.get("tool_calls") or []
        if call["function"]["name"] == "submit_answer"
    ]
    if not submitted:
        return 0.0
    try:
        return float(is_correct(json.loads(submitted[-1]).get("answer"), answer))
    except (ValueError, AttributeError):
        return 0.0


def problems(count: int, max_operand: int, seed: int, split: str) -> Dataset:
    """``count`` problems ``a op b`` (deterministic for a seed and split)."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for _ in range(count):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice("+-*")
        rows.append(
            {
                "question": f"What is {a} {op} {b}?",
                "answer": str({"+": a + b, "-": a - b, "*": a * b}[op]),
                "info": json.dumps({"oai_tools": TOOLS}),
            }
        )
    return Dataset.from_list(rows)


def load_environment(
    train: int = 512, test: int = 64, max_operand: int = 9, seed: int = 0, max_turns: int = 4
) -> vf.Environment:
    return ArithmeticEnv(
        dataset=problems(train, max_operand, seed, "train"),
        eval_dataset=problems(test, max_operand, seed, "test"),
        system_prompt=SYSTEM,
        rubric=vf.Rubric(funcs=[submitted_correct]),
        max_turns=max_turns,
    )
