"""The options real clients send on the gateway's Anthropic Messages and OpenAI Responses routes, through the unmodified
``anthropic`` and ``openai`` SDKs on the scripted model: Anthropic's ``messages/count_tokens``, assistant prefill and
``tool_choice``; Responses' ``previous_response_id`` and ``tool_choice``. What the gateway cannot honour exactly (a
forced tool call, ``stop_sequences``) gets 400 naming the field, and leaves the session as it was."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
from openai import AsyncOpenAI

from agentloop.agent_loop.trajectory import observation_delta
from agentloop.dumps import mask_runs
from agentloop.tools.parsers import parse_hermes
from tests import test_gateway
from tests.support.external_agents import SCHEMAS
from tests.support.models import SCRIPTS, script_row
from tests.test_gateway import external
from tests.test_gateway_apis import ANSWER, ANTHROPIC_TOOLS, model_turns, tool_result

# test_gateway's module fixtures: the scripted model, a rollout server on it, its tokenizer
scripted, server, tokenizer = test_gateway.scripted, test_gateway.server, test_gateway.tokenizer

RESPONSES_TOOLS = [{"type": "function", **schema["function"]} for schema in SCHEMAS]
# what the last program run saw, by name
SEEN: dict[str, Any] = {}


def anthropic_client(base_url: str, api_key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)


async def counting_anthropic(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """count_tokens of the row's request, then the request itself."""
    client = anthropic_client(base_url, api_key)
    request = {"model": "m", "system": "Be brief.", "messages": row["prompt"], "tools": ANTHROPIC_TOOLS}
    SEEN["counted"] = (await client.messages.count_tokens(**request)).input_tokens
    SEEN["input_tokens"] = (await client.messages.create(max_tokens=999, **request)).usage.input_tokens
    return 1.0


def test_count_tokens_is_the_context_a_call_gets_and_records_nothing(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, function=f"{__name__}.counting_anthropic")
    context = [{"role": "system", "content": "Be brief."}, *script_row("multi")["prompt"]]
    rendered = tokenizer.apply_chat_template(
        context, tools=SCHEMAS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert SEEN["counted"] == SEEN["input_tokens"] == len(rendered)
    # the count left no trace: the call that followed is the session's first, its context the whole prompt
    assert output.metrics["gateway_calls"] == 1 and not output.segments and output.prompt_ids == list(rendered)


PREFILL = "<tool_call>\n"


async def prefilling_anthropic(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """A first call whose last message is an assistant turn the reply continues; sent back joined with the reply,
    the tool's result, then the conversation goes on."""
    client = anthropic_client(base_url, api_key)
    prefilled = [*row["prompt"], {"role": "assistant", "content": PREFILL}]
    first = await client.messages.create(model="m", max_tokens=999, messages=prefilled, tools=ANTHROPIC_TOOLS)
    SEEN["continuation"] = "".join(block.text for block in first.content if block.type == "text")
    _, [call] = parse_hermes(PREFILL + SEEN["continuation"])
    result = tool_result(call.name, call.arguments)
    history = [
        *row["prompt"],
        {"role": "assistant", "content": PREFILL + SEEN["continuation"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}]},
    ]
    second = await client.messages.create(model="m", max_tokens=999, messages=history, tools=ANTHROPIC_TOOLS)
    return float(second.stop_reason == "tool_use")


def test_a_prefilled_turn_is_continued_and_sent_back_extends_the_conversation(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, function=f"{__name__}.prefilling_anthropic")
    # the prefill is context (the template's assistant turn left open), the reply the rest of the scripted turn
    prefilled = [*script_row("multi")["prompt"], {"role": "assistant", "content": PREFILL}]
    assert output.prompt_ids == list(
        tokenizer.apply_chat_template(
            prefilled, tools=SCHEMAS, continue_final_message=True, tokenize=True, return_dict=False
        )
    )
    assert PREFILL + SEEN["continuation"] == SCRIPTS["multi"][0]
    assert tokenizer.decode(model_turns(output)[0]) == SEEN["continuation"] + "<|im_end|>"
    # sent back as one assistant message, the prefill and the reply are the turn recorded: one segment
    assert output.reward_score == 1.0 and not output.segments and output.metrics["gateway_calls"] == 2
    assert [value for value, _, _ in mask_runs(output.response_mask)] == [1, 0, 1]
    observation = [output.response_ids[a:b] for value, a, b in mask_runs(output.response_mask) if value == 0]
    assert observation == [observation_delta(tokenizer, [{"role": "tool", "content": "5"}])]


async def choosy_anthropic(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """What each refused option answers, then a call with tool_choice none."""
    client = anthropic_client(base_url, api_key)
    request = {"model": "m", "max_tokens": 999, "messages": row["prompt"], "tools": ANTHROPIC_TOOLS}
    refused = {
        "any": {"tool_choice": {"type": "any"}},
        "tool": {"tool_choice": {"type": "tool", "name": "calculator"}},
        "one call": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
        "stop": {"stop_sequences": ["</tool_call>"]},
        "prefill with a call": {
            "messages": [
                *row["prompt"],
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            ]
        },
    }
    for name, options in refused.items():
        try:
            await client.messages.create(**{**request, **options})
            SEEN[name] = None
        except anthropic.BadRequestError as error:
            SEEN[name] = (error.status_code, error.body["error"]["message"])
    reply = await client.messages.create(**request, tool_choice={"type": "none"})
    SEEN["none"] = (reply.stop_reason, [block.type for block in reply.content], reply.content[0].text)
    return 1.0


def test_anthropic_options_that_cannot_be_honoured_get_400_naming_them(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, function=f"{__name__}.choosy_anthropic")
    for name, field in (
        ("any", "tool_choice"),
        ("tool", "tool_choice"),
        ("one call", "disable_parallel_tool_use"),
        ("stop", "stop_sequences"),
        ("prefill with a call", "prefill"),
    ):
        assert SEEN[name] is not None and SEEN[name][0] == 400 and field in SEEN[name][1], (name, SEEN[name])
    # tool_choice none: the model's call is left as the text it wrote, no tool_use block
    assert SEEN["none"] == ("end_turn", ["text"], SCRIPTS["multi"][0])
    # the refused calls left nothing: the session's one call is its trajectory
    assert output.metrics["gateway_calls"] == 1 and not output.segments


async def chaining_responses(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """The tool loop on the Responses API, each call sending only what follows its previous response."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    response = await client.responses.create(model="m", input=row["prompt"], tools=RESPONSES_TOOLS)
    SEEN["chained"] = [response.previous_response_id]
    for _ in range(4):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return float(response.output_text == ANSWER)
        results = [
            {"type": "function_call_output", "call_id": call.call_id, "output": tool_result(call.name, _json(call))}
            for call in calls
        ]
        previous = response.id
        response = await client.responses.create(
            model="m", previous_response_id=previous, input=results, tools=RESPONSES_TOOLS
        )
        SEEN["chained"].append(response.previous_response_id == previous)
    return 0.0


def _json(call: Any) -> dict[str, Any]:
    import json

    return json.loads(call.arguments)


def test_previous_response_id_continues_the_stored_conversation_as_one_segment(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, function=f"{__name__}.chaining_responses")
    assert SEEN["chained"] == [None, True, True]
    assert output.reward_score == 1.0 and not output.segments and output.metrics["gateway_calls"] == 3
    assert [value for value, _, _ in mask_runs(output.response_mask)] == [1, 0, 1, 0, 1]
    assert [tokenizer.decode(reply) for reply in model_turns(output)] == [
        turn + "<|im_end|>" for turn in SCRIPTS["multi"]
    ]


async def choosy_responses(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """What each refused option answers, then a call with tool_choice none, then one naming an unstored response."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    request = {"model": "m", "input": row["prompt"], "tools": RESPONSES_TOOLS}
    refused = {
        "required": {"tool_choice": "required"},
        "named": {"tool_choice": {"type": "function", "name": "calculator"}},
        "unknown previous": {"previous_response_id": "resp_nobody"},
        "conversation": {"conversation": "conv_1"},
    }
    unstored = await client.responses.create(**request, tool_choice="none", store=False)
    SEEN["none"] = ([item.type for item in unstored.output], unstored.output_text)
    refused["unstored previous"] = {"previous_response_id": unstored.id}
    for name, options in refused.items():
        try:
            await client.responses.create(**{**request, **options})
            SEEN[name] = None
        except openai.BadRequestError as error:
            SEEN[name] = (error.status_code, error.body["message"])
    return 1.0


def test_responses_options_that_cannot_be_honoured_get_400_naming_them(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, function=f"{__name__}.choosy_responses")
    for name, field in (
        ("required", "tool_choice"),
        ("named", "tool_choice"),
        ("unknown previous", "previous_response_id"),
        ("unstored previous", "previous_response_id"),
        ("conversation", "conversation"),
    ):
        assert SEEN[name] is not None and SEEN[name][0] == 400 and field in SEEN[name][1], (name, SEEN[name])
    assert SEEN["none"] == (["message"], SCRIPTS["multi"][0])
    assert output.metrics["gateway_calls"] == 1 and not output.segments
