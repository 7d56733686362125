"""Real agent frameworks, unmodified, trained through the session gateway: the examples written against the OpenAI SDK,
the OpenAI Agents SDK and LangGraph run as ``external_agent`` loops through one manager on the scripted model, greedy
and sampled, and what the gateway recorded is exact: each reply's tokens as the engine produced them from the recorded
context (greedy: the teacher-forced argmax; sampled: rollout logprobs equal to the teacher-forced ones), each tool
message the framework sent back as the template's delta (mask 0), one segment per trajectory.

The scripted model replays its script only under the tool schemas it was trained with (tests/support/scripted_tools.yaml);
under the examples' own schemas (arithmetic_tools.TOOLS, or derived from their Python signatures) its greedy reply is a
malformed call the gateway returns as text, so each example makes one model call. Two variants of the examples'
frameworks offer the training schemas, so that tool calls, tool messages and the history the frameworks send back go
through the gateway too: the Agents SDK's, non-streamed, and LangGraph's, streamed.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import pytest
import torch
import yaml
from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.batch import trajectory_sizes
from agentloop.dumps import mask_runs
from agentloop.tools.parsers import parse_hermes
from examples.external_agents import arithmetic_tools
from tests.support.external_agents import SCHEMAS, agents_sdk_tool
from tests.support.models import SCRIPTS, script_row
from tests.test_tool_agent import tool_config

TRUTH = 5
EXAMPLES = {
    "openai_sdk_agent": "examples.external_agents.arithmetic_openai.agent",
    "agents_sdk_agent": "examples.external_agents.arithmetic_agents_sdk.agent",
    "langgraph_agent": "examples.external_agents.arithmetic_langgraph.agent",
}
SCRIPTED = {
    "scripted_agents_sdk": f"{__name__}.scripted_agents_sdk",
    "scripted_langgraph": f"{__name__}.scripted_langgraph",
}
PROGRAMS = {**EXAMPLES, **SCRIPTED, "o_series_langchain": f"{__name__}.o_series_langchain"}
SYSTEM = "Be brief."


def tool_result(name: str, arguments: dict[str, Any]) -> str:
    """What the examples' tools (and the variants' below) answer to a call."""
    if name == "calculator":
        return arithmetic_tools.calculator(str(arguments.get("expression", "")))
    return "correct" if arithmetic_tools.is_correct(arguments.get("answer"), TRUTH) else "incorrect"


class WithoutStrict(httpx.AsyncBaseTransport):
    """Sends requests without the ``strict`` key the Agents SDK puts in every tool schema: the scripted model was
    trained on schemas without it, and replays its script only under them."""

    def __init__(self) -> None:
        self.transport = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        for schema in body.get("tools") or []:
            schema["function"].pop("strict", None)
        headers = {key: value for key, value in request.headers.items() if key != "content-length"}
        sent = httpx.Request(request.method, request.url, headers=headers, json=body, extensions=request.extensions)
        return await self.transport.handle_async_request(sent)


async def scripted_agents_sdk(base_url: str, api_key: str, row: dict[str, Any]) -> None:
    client = AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=httpx.AsyncClient(transport=WithoutStrict())
    )
    solver = Agent(
        name="scripted",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        tools=[agents_sdk_tool(schema, tool_result) for schema in SCHEMAS],
    )
    with contextlib.suppress(MaxTurnsExceeded):  # a sampled run may call tools on and on
        await Runner.run(solver, list(row["prompt"]), max_turns=4, run_config=RunConfig(tracing_disabled=True))


@tool
def calculator(expression: str) -> str:
    """Evaluate arithmetic."""
    return tool_result("calculator", {"expression": expression})


@tool
def submit_answer(answer: float) -> str:
    """Submit the answer."""
    return tool_result("submit_answer", {"answer": answer})


LANGGRAPH_TOOLS = ToolNode([calculator, submit_answer])


async def scripted_langgraph(base_url: str, api_key: str, row: dict[str, Any]) -> None:
    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0, streaming=True).bind_tools(
        SCHEMAS
    )

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", LANGGRAPH_TOOLS)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    with contextlib.suppress(GraphRecursionError):
        await graph.compile().ainvoke({"messages": list(row["prompt"])}, {"recursion_limit": 8})


async def o_series_langchain(base_url: str, api_key: str, row: dict[str, Any]) -> None:
    """LangChain names the model's system message OpenAI's ``developer`` role for o-series models."""
    model = ChatOpenAI(model="o3", base_url=base_url, api_key=api_key, max_retries=0)
    await model.ainvoke([{"role": "system", "content": SYSTEM}, *row["prompt"]])


@pytest.fixture(scope="module")
def manager(local_ray, scripted_model, tmp_path_factory):
    """One manager whose registry has an ``external_agent`` entry per program."""
    entries = [
        {"name": name, "_target_": "agentloop.agent_loop.external_agent.ExternalAgentLoop", "function": function}
        for name, function in PROGRAMS.items()
    ]
    path = tmp_path_factory.mktemp("registry") / "frameworks.yaml"
    path.write_text(yaml.safe_dump(entries))
    manager = AgentLoopManager(
        tool_config(scripted_model, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}")
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def tokenizer(scripted_model):
    return AutoTokenizer.from_pretrained(scripted_model.path)


@pytest.fixture(scope="module")
def policy(scripted_model):
    return AutoModelForCausalLM.from_pretrained(scripted_model.path, dtype=torch.float32)


def rollout(manager, validate: bool) -> tuple[Any, dict[str, int]]:
    """Every program's trajectory from one ``generate_sequences`` call: the batch, and each program's row in it."""
    rows = [script_row("multi", agent_name=name, reward_model={"ground_truth": TRUTH}) for name in PROGRAMS]
    return manager.generate_sequences(rows, validate=validate), {name: i for i, name in enumerate(PROGRAMS)}


@pytest.fixture(scope="module")
def greedy(manager):
    """Greedy (``val_kwargs``): the scripted model replays its script where it can; logprobs are those of top-1
    sampling (0), so what a teacher-forced forward confirms is that each token is its argmax."""
    return rollout(manager, validate=True)


@pytest.fixture(scope="module")
def sampled(manager):
    """Sampled at temperature 1: the replies are random, and their rollout logprobs are the model's own. A random reply
    may call a tool the program does not have, which the Agents SDK raises on (its sample fails, and the manager refuses
    the batch): such a batch is drawn again."""
    for _ in range(3):
        try:
            return rollout(manager, validate=False)
        except RuntimeError as error:
            if "ModelBehaviorError" not in str(error):
                raise
    return rollout(manager, validate=False)


def recorded(
    batch, index: dict[str, int], name: str, tokenizer
) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Program ``name``'s prompt, response, model-token mask and rollout logprobs, unpadded, once the sample is checked
    to hold the framework's calls as the gateway answered them: a reply per call, and after each reply exactly the
    template's delta of the tool messages the framework sent for its calls (logprob 0)."""
    i = index[name]
    assert batch.non_tensor_batch["failure"][i] is None and batch.non_tensor_batch["end_reason"][i] != "failed"
    prompt_length = batch.batch["prompts"].shape[1]
    length = int(batch.batch["attention_mask"][i, prompt_length:].sum())
    prompt = batch.batch["prompts"][i][batch.batch["attention_mask"][i, :prompt_length].bool()].tolist()
    response = batch.batch["responses"][i, :length].tolist()
    mask, logprobs = batch.batch["response_mask"][i, :length], batch.batch["rollout_log_probs"][i, :length]
    runs = mask_runs(mask.tolist())
    replies = [response[a:b] for value, a, b in runs if value == 1]
    observations = [response[a:b] for value, a, b in runs if value == 0]
    assert [value for value, _, _ in runs] == [1, 0] * len(observations) + [1]
    assert batch.non_tensor_batch["metrics"][i]["gateway_calls"] == len(replies)
    for reply, observation in zip(replies, observations):
        assert observation == observation_delta(tokenizer, tool_messages(tokenizer, reply, name))
    if batch.non_tensor_batch["end_reason"][i] == "stop":
        assert tool_messages(tokenizer, replies[-1], name) == []  # the program ended on a reply without calls
    assert torch.all(logprobs[mask == 0] == 0)
    return prompt, response, mask.bool(), logprobs


def teacher_forced(policy, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's log-probabilities over the vocabulary at each response position, given all before it."""
    with torch.no_grad():
        return torch.log_softmax(policy(torch.tensor([prompt + response])).logits[0].float(), -1)[len(prompt) - 1 : -1]


def tool_calls(tokenizer, reply: list[int]) -> list[Any]:
    """The calls the gateway returned for a reply: none when any call is malformed (it returns the text then)."""
    _, calls = parse_hermes(tokenizer.decode(reply[:-1] if reply[-1] == tokenizer.eos_token_id else reply))
    return [] if any(call.error is not None for call in calls) else calls


def tool_messages(tokenizer, reply: list[int], name: str) -> list[dict[str, Any]]:
    """The tool messages program ``name`` sends back for a reply: one per call, with its tool's answer. LangGraph's
    are its ToolNode's own answers to the calls, which for a call of a tool it lacks (a sampled reply may make one) or
    with arguments its tool's signature refuses are its error texts."""
    calls = tool_calls(tokenizer, reply)
    if name != "scripted_langgraph" or not calls:
        return [{"role": "tool", "content": tool_result(call.name, call.arguments)} for call in calls]
    message = AIMessage(
        content="",
        tool_calls=[{"name": call.name, "args": call.arguments, "id": f"call-{k}"} for k, call in enumerate(calls)],
    )
    graph = StateGraph(MessagesState)
    graph.add_node("tools", LANGGRAPH_TOOLS)
    graph.add_edge(START, "tools")
    answered = graph.compile().invoke({"messages": [message]})["messages"][1:]
    return [{"role": "tool", "content": answer.content} for answer in answered]


@pytest.mark.parametrize("fixture", ["greedy", "sampled"])
def test_each_trajectory_is_one_segment(request, fixture):
    batch, index = request.getfixturevalue(fixture)
    assert trajectory_sizes(batch.batch["segment_index"]) == [1] * len(
        index
    )  # the frameworks send history back unchanged


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_greedy_replies_are_the_models_argmax_in_the_recorded_context(greedy, tokenizer, policy, name):
    batch, index = greedy
    prompt, response, mask, _ = recorded(batch, index, name, tokenizer)
    # a program the policy never saw in training (o_series_langchain's system message) may run to its budget
    assert batch.non_tensor_batch["end_reason"][index[name]] in ("stop", "length")
    assert teacher_forced(policy, prompt, response).argmax(-1)[mask].tolist() == torch.tensor(response)[mask].tolist()


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_sampled_logprobs_are_the_models_in_the_recorded_context(sampled, tokenizer, policy, name):
    batch, index = sampled
    prompt, response, mask, logprobs = recorded(batch, index, name, tokenizer)
    reference = teacher_forced(policy, prompt, response).gather(-1, torch.tensor(response)[:, None])[:, 0]
    assert torch.allclose(logprobs[mask], reference[mask], atol=1e-4)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_an_example_returns_its_reward(greedy, tokenizer, name):
    batch, index = greedy
    _, response, mask, _ = recorded(batch, index, name, tokenizer)
    answers = [
        call.arguments.get("answer")
        for value, a, b in mask_runs(mask.int().tolist())
        if value == 1
        for call in tool_calls(tokenizer, response[a:b])
        if call.name == "submit_answer"
    ]
    assert batch.non_tensor_batch["reward_score"][index[name]] == float(
        bool(answers) and arithmetic_tools.is_correct(answers[-1], TRUTH)
    )


@pytest.mark.parametrize("name", list(SCRIPTED))
def test_a_framework_offering_the_training_tools_replays_the_script(greedy, tokenizer, name):
    batch, index = greedy
    _, response, mask, _ = recorded(batch, index, name, tokenizer)
    replies = [tokenizer.decode(response[a:b]) for value, a, b in mask_runs(mask.int().tolist()) if value == 1]
    assert replies == [turn + "<|im_end|>" for turn in SCRIPTS["multi"]]


def test_a_developer_message_is_rendered_as_a_system_message(greedy, tokenizer):
    batch, index = greedy
    prompt, _, _, _ = recorded(batch, index, "o_series_langchain", tokenizer)
    messages = [{"role": "system", "content": SYSTEM}, *script_row("multi")["prompt"]]
    assert prompt == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
