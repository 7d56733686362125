"""Reasoning models with Qwen3's real thinking template: the generation prompt opens ``<think>``, so a turn starts
inside the reasoning and only its ``</think>`` is the model's. A call written before it is not made, by the
tool loop or the chat API; the chat API returns the reasoning apart; a client that sends the answer back gets
the sampled tokens rendered again; tool schemas reach the template as written, in both.

Real components throughout: a ``RolloutServer`` actor with its HTTP front, the ``Router``, ``ToolAgentLoop``
and the tools; only the engine replays scripted turns (``tests/support/thinking_model.py``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import ray
import requests
import yaml
from transformers import AutoTokenizer

from agentloop.agent_loop.tool_agent import ToolAgentLoop
from agentloop.protocol import AgentLoopOutput
from agentloop.router import Router
from agentloop.server.rollout_server import RolloutServer
from agentloop.settings import rollout_settings
from tests.support.config import small_config
from tests.support.thinking_model import (
    NON_ASCII_ARGUMENTS,
    QWEN3_CONFIG,
    TOOLS_PATH,
    TURNS,
    turn_prompt,
    with_qwen3_template,
)

pytestmark = pytest.mark.skipif(not QWEN3_CONFIG.exists(), reason="../shared/fixtures/qwen3 is not present")

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
# turn -> (reasoning, content, calls) as the chat API returns them; the tool loop makes the same calls
EXPECTED = {
    "call_while_reasoning": (TURNS["call_while_reasoning"].split("\n</think>")[0], "No tool needed.", []),
    "call_after_reasoning": ("Add them.", None, [("calculator", {"expression": "2 + 3"})]),
    "cut_off_while_reasoning": (TURNS["cut_off_while_reasoning"], "", []),
}


@pytest.fixture(scope="module")
def config(model_path, tmp_path_factory):
    qwen3_model = with_qwen3_template(model_path, tmp_path_factory.mktemp("qwen3-template") / "model")
    return small_config(
        f"actor_rollout_ref.model.path={qwen3_model}",
        "actor_rollout_ref.rollout.name=tests.support.thinking_model.ThinkingReplayEngine",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS_PATH}",
        "data.max_prompt_length=768",
        "data.max_response_length=256",
    )


@pytest.fixture(scope="module")
def tokenizer(config):
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], tokenize=False, add_generation_prompt=True
    ).endswith("<|im_start|>assistant\n<think>\n"), "the model directory must carry Qwen3's thinking template"
    return tokenizer


@pytest.fixture(scope="module")
def server(local_ray, config):
    server = RolloutServer.remote(rollout_settings(config).servers, 0)
    ray.get(server.__ray_ready__.remote(), timeout=120)
    yield server
    ray.kill(server)


@pytest.fixture(scope="module")
def url(server):
    return ray.get(server.start_http.remote(), timeout=60)


def written_tools() -> list[dict]:
    """The tool schemas exactly as the YAML writes them: what a chat client would send."""
    return [entry["tool_schema"] for entry in yaml.safe_load(Path(TOOLS_PATH).read_text())["tools"]]


def run_tool_loop(server, tokenizer, config, name: str) -> AgentLoopOutput:
    loop = ToolAgentLoop(server_manager=Router([server]), tokenizer=tokenizer, config=config)
    row = {"prompt": turn_prompt(name), "agent_name": "tool_agent", "request_id": f"{name}-{id(loop)}"}
    return asyncio.run(loop.run(dict(GREEDY), **row))


def chat(url: str, messages: list[dict], **fields) -> dict:
    body = {"messages": messages, "tools": written_tools(), "temperature": 0.0, **fields}
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_only_calls_after_the_reasoning_are_made_by_the_tool_loop(server, tokenizer, config, name):
    calls = EXPECTED[name][2]
    output = run_tool_loop(server, tokenizer, config, name)
    first = output.turns[0]
    made = [(record.name, record.arguments) for record in first.calls]
    assert made == calls and first.tool_calls == len(calls)
    assert output.end_reason == "stop"
    if calls:
        assert first.calls[0].result == "5" and first.calls[0].error is None
    # the records render back to the sampled tokens, but for a turn cut off inside its reasoning: the
    # template closes every reasoning it renders, and the sanity check reports that turn
    assert (output.metrics["tokenization_mismatch"] > 0) == (name == "cut_off_while_reasoning")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_chat_api_returns_the_reasoning_apart_and_calls_only_from_the_content(url, name):
    reasoning, content, calls = EXPECTED[name]
    choice = chat(url, turn_prompt(name))["choices"][0]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    returned = [
        (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"] or []
    ]
    assert returned == calls
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")


def test_a_message_sent_back_renders_the_sampled_tokens_again(url):
    """Non-ASCII arguments come back unescaped and the reasoning apart, so the template rebuilds the turn."""
    first = chat(url, turn_prompt("non_ascii_arguments"))
    message = first["choices"][0]["message"]
    [call] = message["tool_calls"]
    assert "Grüße aus Zürich, 東京 👋" in call["function"]["arguments"]
    assert json.loads(call["function"]["arguments"]) == NON_ASCII_ARGUMENTS
    tool = {"role": "tool", "tool_call_id": call["id"], "content": NON_ASCII_ARGUMENTS["text"]}
    second = chat(url, [*turn_prompt("non_ascii_arguments"), message, tool], max_tokens=1)
    sampled = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"][: len(sampled)] == sampled


def test_tool_schemas_render_as_written_in_the_tool_loop_and_the_chat_api(server, tokenizer, config, url):
    output = run_tool_loop(server, tokenizer, config, "call_while_reasoning")
    answer = chat(url, turn_prompt("call_while_reasoning"))
    assert output.prompt_ids == answer["prompt_token_ids"]
    echo = written_tools()[1]
    assert "description" not in echo["function"]
    assert json.dumps(echo, ensure_ascii=False) in tokenizer.decode(output.prompt_ids)
