"""An arithmetic agent on the OpenAI Agents SDK: an ``Agent`` with two function tools, run by ``Runner`` over a Chat
Completions model; it returns 1.0 when it submitted the right answer. Nothing here knows agentloop; ``external_agent``
hands it a session's base URL and key:

    actor_rollout_ref.rollout.agent.external.function=examples.external_agents.arithmetic_agents_sdk.agent
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
)
from openai import AsyncOpenAI

from examples.external_agents import arithmetic_tools

MAX_TURNS = 4


@dataclass
class Attempt:
    """The run's context: the task's ground truth and what the agent submitted."""

    truth: Any
    answer: float | None = None


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 12 * (3 + 4)
    """
    return arithmetic_tools.calculator(expression)


@function_tool
def submit_answer(wrapper: RunContextWrapper[Attempt], answer: float) -> str:
    """Submit the final numeric answer."""
    wrapper.context.answer = answer
    return "correct" if arithmetic_tools.is_correct(answer, wrapper.context.truth) else "incorrect"


async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    solver = Agent(
        name="arithmetic",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        tools=[calculator, submit_answer],
    )
    attempt = Attempt(truth=row["reward_model"]["ground_truth"])
    try:
        await Runner.run(
            solver,
            list(row["prompt"]),
            context=attempt,
            max_turns=MAX_TURNS,
            run_config=RunConfig(tracing_disabled=True),
        )
    except MaxTurnsExceeded:
        pass  # out of turns: judged on what it submitted
    return float(arithmetic_tools.is_correct(attempt.answer, attempt.truth))
