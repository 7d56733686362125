"""An arithmetic agent on the OpenAI SDK alone: it calls the model with two tools, runs them itself and returns 1.0
when it submitted the right answer. Nothing here knows agentloop; ``external_agent`` hands it a session's base URL:

    actor_rollout_ref.rollout.agent.external.function=examples.external_agents.arithmetic_openai.agent

or runs it as a command (``...external.command="python -m examples.external_agents.arithmetic_openai"``), reading
the row from stdin, the base URL and key from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, printing the reward last.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from openai import AsyncOpenAI

from examples.external_agents.arithmetic_tools import TOOLS, calculator, is_correct

MAX_TURNS = 4


async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row["prompt"])
    submitted = None
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            if call.function.name == "calculator":
                result = calculator(str(arguments.get("expression", "")))
            else:
                submitted = arguments.get("answer")
                result = "correct" if is_correct(submitted, row["reward_model"]["ground_truth"]) else "incorrect"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float(is_correct(submitted, row["reward_model"]["ground_truth"]))


if __name__ == "__main__":  # the command-line form: OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    import os

    print(asyncio.run(agent(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], json.load(sys.stdin))))
