"""verifiers environments written against ``verifiers``' public API only, as an environment package would be: this
module is the package (``vf.load_environment("tests.support.verifiers_envs", kind=...)``).

- ``counting``: a ``MultiTurnEnv`` that answers each model turn with ``count <n>`` for ``turns`` turns, rewards each
  turn (``add_trajectory_step``) and scores the rollout with a rubric of two weighted functions (one using its parser);
- ``tools``: a ``ToolEnv`` with a calculator and ``submit_answer`` (which says whether the answer is ``answer``), its
  rubric checking the submitted answer;
- ``raises``, ``hangs``, ``malformed``: multi-turn environments whose ``env_response`` raises, never returns, or
  returns a message no chat template takes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import verifiers as vf
from datasets import Dataset

from examples.external_agents.arithmetic_tools import calculator as evaluate


class CountingEnv(vf.MultiTurnEnv):
    """``count <n>`` after the model's n-th turn; each turn's reward is a quarter of its number."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        return [{"role": "user", "content": f"count {len(state['trajectory'])}"}]

    async def add_trajectory_step(self, state: vf.State, trajectory_step: vf.TrajectoryStep) -> None:
        trajectory_step["reward"] = 0.25 * (len(state["trajectory"]) + 1)
        await super().add_trajectory_step(state, trajectory_step)


class RaisingEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        raise KeyError("the environment's own bug")


class HangingEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        await asyncio.sleep(3600)
        return []


class MalformedEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        return [{"role": "observation", "content": {"not": "text"}}]


def said_ok(completion: vf.Messages, parser: vf.Parser) -> float:
    """1 when the model's last reply, parsed, is ``ok``."""
    return 1.0 if (parser.parse_answer(completion) or "").strip() == "ok" else 0.0


def turns_taken(state: vf.State) -> float:
    return float(len(state["trajectory"]))


def calculator(expression: str) -> str:
    """Evaluate arithmetic.

    Args:
        expression: the expression
    """
    return evaluate(expression)


def submitted_correct(completion: vf.Messages, answer: str) -> float:
    """1 when the last ``submit_answer`` call submitted the answer."""
    submitted = [
        json.loads(call["function"]["arguments"]).get("answer")
        for message in completion
        if message["role"] == "assistant"
        for call in message.get("tool_calls") or []
        if call["function"]["name"] == "submit_answer"
    ]
    return 1.0 if submitted and float(submitted[-1]) == float(answer) else 0.0


def load_environment(
    kind: str = "counting", turns: int = 3, question: str = "start 1", answer: str = "5"
) -> vf.Environment:
    dataset = Dataset.from_list([{"question": question, "answer": answer}])
    if kind == "tools":

        def submit_answer(answer: float) -> str:
            """Submit the answer.

            Args:
                answer: the answer
            """
            return "correct" if float(answer) == float(expected) else "incorrect"

        expected = answer
        rubric = vf.Rubric(funcs=[submitted_correct])
        return vf.ToolEnv(tools=[calculator, submit_answer], dataset=dataset, rubric=rubric, max_turns=turns)
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[said_ok, turns_taken], weights=[1.0, 0.5], parser=parser)
    env_class = {"counting": CountingEnv, "raises": RaisingEnv, "hangs": HangingEnv, "malformed": MalformedEnv}[kind]
    return env_class(dataset=dataset, parser=parser, rubric=rubric, max_turns=turns)
