"""Reward functions and an environment that call the judge (``reward_model.*``), for the judge tests. The judge is
the coin model: asked "question N", it answers yes or no."""

from __future__ import annotations

from typing import Any

from agentloop.envs import BaseEnv
from agentloop.judge import Judge, JudgeUnparsable


def question(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {index}"}]


async def ask_the_judge(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, *, judge: Judge, reward_router_address: str, **kwargs: Any
) -> dict[str, Any]:
    """1 when the judge says yes to the row's question; its text and verl's router address go to reward_extra_info."""
    text = await judge.chat(question(extra_info["index"]))
    return {"score": float(text.startswith("yes")), "judge_text": text, "reward_router_address": reward_router_address}


async def impatient(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, judge: Judge) -> float:
    """A judge call that cannot finish in time: a long reply within a millisecond."""
    await judge.chat(question(extra_info["index"]), timeout_s=0.001, max_new_tokens=64, ignore_eos=True)
    return 1.0


def read_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise JudgeUnparsable(text, "expected a number") from None


async def wants_a_number(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, judge: Judge) -> float:
    """A grade read as a number from a judge that says yes or no: unparsable."""
    return await judge.grade(question(extra_info["index"]), read_number)


class JudgedEnv(BaseEnv):
    """Each turn is graded by the judge (question <turn>): its yes is the turn's reward, its text the observation."""

    def reset(self) -> None:
        self.turn = 0

    async def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        self.turn += 1
        text = await self.judge.chat(question(self.turn))
        return f"the judge says {text}", self.turn == 2, {"reward": float(text.startswith("yes"))}
