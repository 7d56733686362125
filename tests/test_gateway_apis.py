"""The session gateway's Anthropic Messages and OpenAI Responses routes, driven by the unmodified SDKs from PyPI: a
tool-using agent on the ``anthropic`` SDK and one on the OpenAI Agents SDK's default (Responses) model, rolled out on
the scripted model through a real rollout server. What the gateway recorded is exact (each reply's tokens the ones
the engine sampled and the API returned, greedy replaying the script, sampled logprobs the teacher-forced ones; the
tool results the program sent back the template's delta, mask 0), the program's own reward is the sample's, history
a program rewrites starts a new segment, and malformed requests get 400 in each API's own error shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from agents import Agent, MaxTurnsExceeded, ModelBehaviorError, RunConfig, Runner
from agents.models.openai_provider import OpenAIProvider
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI

from agentloop.agent_loop.trajectory import observation_delta
from agentloop.dumps import mask_runs
from examples.external_agents.arithmetic_tools import calculator
from tests.support.external_agents import SCHEMAS, agents_sdk_tool
from tests.support.models import SCRIPTS, script_row
from tests import test_gateway
from tests.test_gateway import SAMPLED, assert_exact, external

# test_gateway's module fixtures: the scripted model, a rollout server on it, its tokenizer, the model in torch
scripted, server, tokenizer, model = (
    test_gateway.scripted,
    test_gateway.server,
    test_gateway.tokenizer,
    test_gateway.model,
)

ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (schema["function"] for schema in SCHEMAS)
]
ANSWER = "The answer is 5."
# the token ids each reply of the last program run came with (the API's ``token_ids`` field), in order
RETURNED: list[list[int]] = []
# the previous_response_id of each Responses call the last Agents-SDK program made
CHAINED: list[str | None] = []


def tool_result(name: str, arguments: dict[str, Any]) -> str:
    return calculator(str(arguments.get("expression", ""))) if name == "calculator" else "correct"


async def anthropic_agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Claude-style tool use: each reply's blocks sent back as they came, each tool_use answered by a tool_result;
    streamed when the row says so. Its reward: whether its final text is the answer."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row["prompt"])
    RETURNED.clear()
    for _ in range(5):
        arguments = {"model": "policy", "max_tokens": 999, "messages": messages, "tools": ANTHROPIC_TOOLS}
        if row["extra_info"].get("stream"):
            async with client.messages.stream(**arguments) as stream:
                reply = await stream.get_final_message()
        else:
            reply = await client.messages.create(**arguments)
        RETURNED.append(reply.model_extra.get("token_ids"))
        messages.append({"role": "assistant", "content": reply.content})
        calls = [block for block in reply.content if block.type == "tool_use"]
        if reply.stop_reason != "tool_use":
            return float("".join(block.text for block in reply.content if block.type == "text") == ANSWER)
        results = [
            {"type": "tool_result", "tool_use_id": call.id, "content": tool_result(call.name, call.input)}
            for call in calls
        ]
        messages.append({"role": "user", "content": results})
    return 0.0


async def agents_sdk_agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """An Agents-SDK agent with no model named: the provider's default, the Responses model; with ``chain``, each call
    sends only what follows its previous response (``previous_response_id``). Its reward: whether its final output is
    the answer."""
    CHAINED.clear()

    async def note(request: httpx.Request) -> None:
        CHAINED.append(json.loads(request.content).get("previous_response_id"))

    http = httpx.AsyncClient(event_hooks={"request": [note]})
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)
    provider = OpenAIProvider(openai_client=client)
    assert isinstance(provider.get_model(None), OpenAIResponsesModel)
    solver = Agent(name="solver", tools=[agents_sdk_tool(schema, tool_result) for schema in SCHEMAS])
    config = RunConfig(model_provider=provider, tracing_disabled=True)
    run = {"max_turns": 4, "run_config": config, "auto_previous_response_id": bool(row["extra_info"].get("chain"))}
    try:
        if row["extra_info"].get("stream"):
            result = Runner.run_streamed(solver, list(row["prompt"]), **run)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(solver, list(row["prompt"]), **run)
    except (ModelBehaviorError, MaxTurnsExceeded):  # a sampled reply may call a tool it does not have, on and on
        return 0.0
    return float(result.final_output == ANSWER)


async def thinking_anthropic(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """A reply with a thinking block sent back as it came, then a user message: the conversation goes on."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    first = await client.messages.create(model="m", max_tokens=999, messages=row["prompt"], tools=ANTHROPIC_TOOLS)
    history = [*row["prompt"], {"role": "assistant", "content": first.content}, {"role": "user", "content": "go on"}]
    await client.messages.create(model="m", max_tokens=999, messages=history, tools=ANTHROPIC_TOOLS)
    return float([block.type for block in first.content] == ["thinking", "text"] and first.stop_reason == "end_turn")


async def thinking_responses(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """A reply with a reasoning item sent back as it came, then a user message: the conversation goes on."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", **schema["function"]} for schema in SCHEMAS]
    first = await client.responses.create(model="m", input=row["prompt"], tools=tools)
    sent_back = [item.model_dump(exclude_none=True) for item in first.output]
    await client.responses.create(
        model="m", input=[*row["prompt"], *sent_back, {"role": "user", "content": "go on"}], tools=tools
    )
    return float([item.type for item in first.output] == ["reasoning", "message"] and first.status == "completed")


async def rewriting_anthropic(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """Two calls on the row's prompt: the second does not extend the first."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    for _ in range(2):
        await client.messages.create(model="m", max_tokens=999, messages=row["prompt"], tools=ANTHROPIC_TOOLS)
    return 1.0


async def rewriting_responses(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """A first call, then one whose history holds a call the model did not make (its own reply edited): a rewrite."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", **schema["function"]} for schema in SCHEMAS]
    await client.responses.create(model="m", input=row["prompt"], tools=tools)
    edited = {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"expression": "3"}'}
    output = {"type": "function_call_output", "call_id": "c1", "output": "3"}
    await client.responses.create(model="m", input=[*row["prompt"], edited, output], tools=tools)
    return 1.0


def model_turns(output) -> list[list[int]]:
    return [output.response_ids[a:b] for value, a, b in mask_runs(output.response_mask) if value == 1]


@pytest.mark.parametrize(
    ("agent", "extra"),
    [
        ("anthropic_agent", {}),
        ("anthropic_agent", {"stream": True}),
        ("agents_sdk_agent", {}),
        ("agents_sdk_agent", {"stream": True}),
        ("agents_sdk_agent", {"chain": True}),
    ],
    ids=["anthropic", "anthropic-streamed", "agents-sdk", "agents-sdk-streamed", "agents-sdk-chained"],
)
def test_an_sdk_agent_is_one_exact_segment_with_its_own_reward(server, tokenizer, scripted, model, agent, extra):
    row = script_row("multi", extra_info=extra)
    output = external(server, tokenizer, scripted, function=f"{__name__}.{agent}", row=row)
    assert output.end_reason == "stop" and not output.segments and output.metrics["gateway_calls"] == 3
    assert output.reward_score == 1.0  # the program's own: the worker's scoring keeps it (``agent_loop``)
    runs = mask_runs(output.response_mask)
    assert [value for value, _, _ in runs] == [1, 0, 1, 0, 1]
    replies = model_turns(output)
    assert [tokenizer.decode(reply) for reply in replies] == [turn + "<|im_end|>" for turn in SCRIPTS["multi"]]
    if agent == "anthropic_agent" and not extra:
        assert RETURNED == replies  # the ids the API returned are the ones recorded
    if extra.get("chain"):  # the SDK sent only what followed each response, naming it
        assert CHAINED[0] is None and all(CHAINED[1:]) and len(CHAINED) == 3
    observations = [output.response_ids[a:b] for value, a, b in runs if value == 0]
    assert observations == [
        observation_delta(tokenizer, [{"role": "tool", "content": text}]) for text in ("5", "correct")
    ]
    assert [(call.name, call.arguments, call.result) for turn in output.turns for call in turn.calls] == [
        ("calculator", {"expression": "2 + 3"}, "5"),
        ("submit_answer", {"answer": 5}, "correct"),
    ]
    sampled = external(server, tokenizer, scripted, function=f"{__name__}.{agent}", row=row, sampling=SAMPLED)
    assert not sampled.segments
    assert_exact(model, sampled)


@pytest.mark.parametrize("agent", ["rewriting_anthropic", "rewriting_responses"])
def test_rewritten_history_starts_a_second_exact_segment(server, tokenizer, scripted, model, agent):
    output = external(server, tokenizer, scripted, function=f"{__name__}.{agent}", sampling=SAMPLED)
    segments = output.all_segments()
    assert len(segments) == 2 and [segment.rewritten_by for segment in segments] == [None, "client"]
    assert output.reward_score == 1.0
    if agent == "rewriting_responses":  # the edited call is part of the new context, rendered from its arguments
        assert '"expression": "3"' in tokenizer.decode(segments[1].prompt_ids)
    assert_exact(model, output)


@pytest.mark.parametrize("agent", ["thinking_anthropic", "thinking_responses"])
def test_a_reply_with_reasoning_sent_back_extends_the_conversation(server, tokenizer, scripted, agent):
    output = external(server, tokenizer, scripted, function=f"{__name__}.{agent}", row=script_row("think"))
    assert output.reward_score == 1.0 and not output.segments and output.metrics["gateway_calls"] == 2
    assert [value for value, _, _ in mask_runs(output.response_mask)] == [1, 0, 1]
    assert tokenizer.decode(model_turns(output)[0]) == SCRIPTS["think"][0] + "<|im_end|>"
    observation = [output.response_ids[a:b] for value, a, b in mask_runs(output.response_mask) if value == 0]
    assert observation == [observation_delta(tokenizer, [{"role": "user", "content": "go on"}])]


def hostile_requests(row: dict[str, Any]) -> dict[str, tuple[str, dict | bytes, int, str]]:
    """name -> (route, body, status, what the error message must name)."""
    prompt = row["prompt"]
    messages = {"model": "m", "max_tokens": 8, "messages": prompt}
    responses = {"model": "m", "input": prompt}
    return {
        "messages: not JSON": ("messages", b'{"messages": [', 400, "JSON"),
        "messages: no max_tokens": ("messages", {"messages": prompt}, 400, "max_tokens"),
        "messages: bad role": ("messages", {**messages, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
        "messages: unknown block": (
            "messages",
            {**messages, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            400,
            "messages.0.content",
        ),
        "messages: tool without schema": ("messages", {**messages, "tools": [{"name": "f"}]}, 400, "input_schema"),
        "messages: image on a text model": (
            "messages",
            {
                **messages,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}
                ],
            },
            400,
            "image",
        ),
        "responses: not JSON": ("responses", b"[1,", 400, "JSON"),
        "responses: no input": ("responses", {"model": "m"}, 400, "input"),
        "responses: unknown item": ("responses", {"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0"),
        "responses: bad arguments": (
            "responses",
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]},
            400,
            "input[0].arguments",
        ),
        "responses: stored state": ("responses", {**responses, "previous_response_id": "resp_1"}, 400, "previous"),
        "responses: good": ("responses", responses, 200, ""),
        "messages: good": ("messages", messages, 200, ""),
    }


def test_malformed_requests_get_400_in_each_apis_shape_and_leave_the_session_working(server, tokenizer, scripted):
    seen: dict[str, tuple[int, dict]] = {}

    async def hostile(base_url: str, api_key: str, row: dict) -> float:
        good = hostile_requests(row)["messages: good"][1]
        async with httpx.AsyncClient(timeout=60, headers={"x-api-key": api_key}) as http:
            for name, (route, body, _, _) in hostile_requests(row).items():
                sent = {"content": body} if isinstance(body, bytes) else {"json": body}
                reply = await http.post(f"{base_url}/{route}", headers={"content-type": "application/json"}, **sent)
                seen[name] = (reply.status_code, reply.json())
            wrong = await http.post(f"{base_url}/messages", headers={"x-api-key": "guess"}, json=good)
            seen["messages: wrong key"] = (wrong.status_code, wrong.json())
        return 1.0

    globals()["hostile"] = hostile
    output = external(server, tokenizer, scripted, function=f"{__name__}.hostile")
    for name, (route, _, status, named) in hostile_requests(script_row("multi")).items():
        got, body = seen[name]
        assert got == status, (name, body)
        if status == 200:
            continue
        if route == "messages":  # Anthropic's shape
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (name, body)
        assert named in body["error"]["message"], (name, body)
    assert seen["messages: wrong key"] == (
        401,
        {
            "type": "error",
            "error": {"type": "authentication_error", "message": seen["messages: wrong key"][1]["error"]["message"]},
        },
    )
    # the two good calls made the trajectory: the second repeats the first's prompt, a second segment
    assert output.metrics["gateway_calls"] == 2 and len(output.all_segments()) == 2
