"""Agent programs for the gateway tests, written against the OpenAI SDK only (the scripted model's tools)."""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from agentloop.tools.toolset import load_tool_set
from examples.external_agents.arithmetic_tools import calculator
from tests.support.models import TOOLS_PATH

SCHEMAS = load_tool_set(TOOLS_PATH).schemas


async def scripted_openai(base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
    """Calls with the scripted model's tools until a reply makes no call; answers calculator and submit_answer."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row["prompt"])
    for _ in range(5):
        message = (await client.chat.completions.create(model="m", messages=messages, tools=SCHEMAS)).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = calculator(arguments["expression"]) if call.function.name == "calculator" else "correct"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
