"""Agent programs for the gateway tests, written against the OpenAI SDK only (the scripted model's tools)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from agents import FunctionTool
from openai import AsyncOpenAI

from agentloop.tools.toolset import load_tool_set
from examples.external_agents.arithmetic_tools import calculator
from tests.support.models import TOOLS_PATH

SCHEMAS = load_tool_set(TOOLS_PATH).schemas


def agents_sdk_tool(schema: dict[str, Any], answer: Callable[[str, dict[str, Any]], str]) -> FunctionTool:
    """An OpenAI Agents SDK tool for a chat tool schema, answered by ``answer(name, arguments)``."""
    function = schema["function"]

    async def invoke(_: Any, arguments: str) -> str:
        return answer(function["name"], json.loads(arguments))

    return FunctionTool(
        name=function["name"],
        description=function["description"],
        params_json_schema=function["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )


async def scripted_openai(base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
    """Calls with the scripted model's tools until a reply makes no call; answers calculator and submit_answer."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row["prompt"])
    for _ in range(5):
        # a temperature and max_tokens of its own: the rollout's sampling params hold whatever a client asks
        completion = await client.chat.completions.create(
            model="m", messages=messages, tools=SCHEMAS, temperature=1.9, max_tokens=999
        )
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = calculator(arguments["expression"]) if call.function.name == "calculator" else "correct"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


async def rewriting_openai(base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
    """Two calls whose second does not extend the first: it asks the row's prompt again (``extra_info.rewrite:
    repeat``) or sends the first reply back with its text edited (``edit``)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row["prompt"])
    first = (await client.chat.completions.create(model="m", messages=messages, tools=SCHEMAS)).choices[0].message
    if row["extra_info"]["rewrite"] == "edit":
        messages = [
            *messages,
            {"role": "assistant", "content": "I will compute 2 + 3."},
            {"role": "user", "content": "go on"},
        ]
    await client.chat.completions.create(model="m", messages=messages, tools=SCHEMAS)
    return float(bool(first.tool_calls))


async def streaming_openai(base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
    """``scripted_openai`` with ``stream=True``: the reply assembled from the chunks, sent back as a plain message."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row["prompt"])
    for _ in range(5):
        content, calls = "", []
        stream = await client.chat.completions.create(model="m", messages=messages, tools=SCHEMAS, stream=True)
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            content += (delta.content or "") if delta else ""
            calls += (delta.tool_calls or []) if delta else []
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
        messages.append(message)
        if not calls:
            return float(content == "The answer is 5.")
        for call in calls:
            result = (
                calculator(json.loads(call.function.arguments)["expression"])
                if call.function.name == "calculator"
                else "correct"
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


async def silent(base_url: str, api_key: str, row: dict[str, Any]) -> None:
    """Makes no model call."""


async def hangs(base_url: str, api_key: str, row: dict[str, Any]) -> None:
    """One call, then never returns."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=row["prompt"], tools=SCHEMAS)
    await asyncio.Event().wait()


if __name__ == "__main__":  # the command form: the row on stdin, the session from the environment; prints the reward
    import os
    import sys

    row = json.load(sys.stdin)
    asyncio.run(scripted_openai(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], row))
    print("0.25")


def recording_reward(data_source, solution_str, ground_truth, extra_info, **kwargs) -> dict[str, Any]:
    """A reward function that reports what it was called with (its ``reward_extra_info``)."""
    return {
        "score": 1.0,
        "arguments": sorted(["data_source", "solution_str", "ground_truth", "extra_info", *kwargs]),
        "extra_info": sorted(extra_info),
        "ground_truth": ground_truth,
        "data_source": data_source,
    }
