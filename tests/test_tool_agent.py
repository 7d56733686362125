"""tool_agent on a real engine with a tiny model fine-tuned to replay scripted turns (greedy)."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.tool_agent import ToolAgentLoop
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.dumps import mask_runs
from agentloop.turn_totals import tool_errors_by_kind
from agentloop.rewards import score_output
from agentloop.settings import reward_settings
from agentloop.router import Router
from tests.support.config import small_config
from tests.support.models import SCRIPTS, script_row

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}


@pytest.fixture(scope="module")
def scripted(scripted_model):
    return scripted_model


def tool_config(scripted, *overrides: str):
    tools_path, model_path, _ = scripted
    return small_config(
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_path}",
        "data.max_prompt_length=768",
        "data.max_response_length=256",
        *overrides,
    )


@pytest.fixture(scope="module")
def manager(local_ray, scripted):
    manager = AgentLoopManager(tool_config(scripted))
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def server(manager):
    """The manager's rollout server, which ``run_loop`` drives through a router of its own."""
    return manager.servers[0]


@pytest.fixture(scope="module")
def tokenizer(scripted):
    return AutoTokenizer.from_pretrained(scripted[1])


def run_loop(server, tokenizer, scripted, name, *overrides, sampling=GREEDY, **fields):
    """One ToolAgentLoop in this process, talking to the real server through a real router."""
    loop = ToolAgentLoop(server_manager=Router([server]), tokenizer=tokenizer, config=tool_config(scripted, *overrides))
    row = {**script_row(name, **fields), "request_id": f"{name}-{id(loop)}"}
    return asyncio.run(loop.run(dict(sampling), **row))


def test_multi_turn_tokens_mask_and_reward_through_the_manager(manager, scripted, tokenizer):
    _, _, conversations = scripted
    batch = manager.generate_sequences([script_row("multi", data_source="tools")], validate=True)
    assert batch.non_tensor_batch["end_reason"][0] == "stop"
    assert batch.non_tensor_batch["num_turns"][0] == 6
    length = int(batch.batch["attention_mask"][0, 768:].sum())
    response = batch.batch["responses"][0, :length].tolist()
    mask = batch.batch["response_mask"][0, :length].tolist()
    logprobs = batch.batch["rollout_log_probs"][0, :length]
    prompt = batch.batch["prompts"][0][batch.batch["attention_mask"][0, :768].bool()].tolist()

    runs = mask_runs(mask)
    assert [value for value, _, _ in runs] == [1, 0, 1, 0, 1]
    # model spans: exactly the scripted turns, each ending in the end-of-turn token
    model_texts = [tokenizer.decode(response[a:b]) for value, a, b in runs if value == 1]
    assert model_texts == [turn + "<|im_end|>" for turn in SCRIPTS["multi"]]
    # observation spans: exactly the template's delta for the tool messages, logprob 0
    tool_messages = [m for m in conversations["multi"] if m["role"] == "tool"]
    observations = [response[a:b] for value, a, b in runs if value == 0]
    assert observations == [observation_delta(tokenizer, [message]) for message in tool_messages]
    assert torch.all(logprobs[torch.tensor(mask) == 0] == 0)
    # each model span is what the engine itself produces from that span's context
    for value, start, end in runs:
        if value == 1:
            again = ray.get(
                manager.servers[0].generate.remote(prompt + response[:start], GREEDY | {"max_new_tokens": 64}, "check")
            )
            assert again.token_ids == response[start:end]
    # the tools' reward sits on the last response token
    assert batch.non_tensor_batch["reward_score"][0] == 1.0
    assert batch.batch["rm_scores"][0, length - 1] == 1.0 and batch.batch["rm_scores"][0].sum() == 1.0
    metrics = batch.non_tensor_batch["metrics"][0]
    assert metrics["tool_calls"] == 2 and metrics["tool_errors"] == 0 and metrics["tokenization_mismatch"] == 0


def test_logprobs_of_sampled_multi_turn_match_teacher_forcing(server, tokenizer, scripted):
    output = run_loop(server, tokenizer, scripted, "multi", sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    model = AutoModelForCausalLM.from_pretrained(scripted[1], dtype=torch.float32)
    ids = torch.tensor([output.prompt_ids + output.response_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(output.prompt_ids)
    reference = log_probs[n - 1 : -1].gather(-1, torch.tensor(output.response_ids)[:, None])[:, 0]
    mask = torch.tensor(output.response_mask).bool()
    rollout = torch.tensor(output.response_logprobs)
    assert torch.allclose(rollout[mask], reference[mask], atol=1e-4)
    assert torch.all(rollout[~mask] == 0)


def test_reward_function_by_data_source(server, tokenizer, scripted):
    reward = "+custom_reward_function.by_data_source.arith=agentloop.tasks.arithmetic.reward.arithmetic_score"
    fields = {"data_source": "arith", "reward_model": {"ground_truth": "5"}}
    output = run_loop(server, tokenizer, scripted, "multi", reward, **fields)
    assert output.reward_score is None  # the loop leaves the reward to the worker's scoring step
    score = asyncio.run(
        score_output(reward_settings(tool_config(scripted, reward)), tokenizer, script_row("multi", **fields), output)
    )
    assert output.reward_score == 1.0 and score.reward_source == "reward_function"
    assert score.reward_extra_info == {"score": 1.0, "answer_found": 1.0}
    assert output.extra_fields == {}  # the loop's own: the framework writes nothing there


def test_calls_inside_think_are_not_executed(server, tokenizer, scripted):
    output = run_loop(server, tokenizer, scripted, "think")
    assert output.end_reason == "stop"
    assert output.metrics["tool_calls"] == 0 and set(output.response_mask) == {1}


def test_parallel_calls_and_their_limit(server, tokenizer, scripted):
    output = run_loop(server, tokenizer, scripted, "parallel")
    assert output.turns[0].tool_calls == 2 and output.turns[0].dropped_calls == 0
    observation = tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask) if m == 0])
    assert observation.count("<tool_response>") == 2 and "\n2\n" in observation and "\n9\n" in observation
    limited = run_loop(
        server, tokenizer, scripted, "parallel", "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1"
    )
    assert limited.turns[0].tool_calls == 1 and limited.turns[0].dropped_calls == 1
    assert [call.error for call in limited.turns[0].calls] == [None, "too_many_calls"]


@pytest.mark.parametrize(
    "script, kind, text",
    [
        ("unknown", "unknown_tool", "Error: unknown tool 'weather'; available tools:"),
        ("malformed", "parse_error", "Error: could not parse the tool call: malformed JSON"),
        (
            "badargs",
            "invalid_arguments",
            "Error: invalid arguments for calculator: 'expression' is a required property",
        ),
        ("raises", "exception", "Error: tool explode failed: RuntimeError: boom"),
        ("slow", "timeout", "Error: tool sleepy timed out after 0.3s"),
    ],
)
def test_faults_become_observations(server, tokenizer, scripted, script, kind, text):
    output = run_loop(server, tokenizer, scripted, script)
    assert tool_errors_by_kind(output.turns) == {kind: 1} and output.metrics["tool_errors"] == 1
    observation = tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask) if m == 0])
    assert text in observation
    assert output.end_reason == "stop" and output.response_mask[-1] == 1


def test_error_budget_ends_cleanly_on_a_model_token(server, tokenizer, scripted):
    output = run_loop(
        server, tokenizer, scripted, "unknown", "actor_rollout_ref.rollout.multi_turn.tool_error_budget=0"
    )
    assert output.end_reason == "tool_error_budget"
    assert set(output.response_mask) == {1} and output.num_turns == 2


@pytest.mark.parametrize(
    "override, reason, assistant_turns",
    [
        ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "max_turns", 2),
        ("actor_rollout_ref.rollout.multi_turn.max_user_turns=1", "max_turns", 2),
        ("data.max_response_length=60", "length", None),
    ],
)
def test_turn_and_token_limits(server, tokenizer, scripted, override, reason, assistant_turns):
    output = run_loop(server, tokenizer, scripted, "loop", override)
    assert output.end_reason == reason
    assert output.response_mask[-1] == 1, "a trajectory never ends on an observation"
    if assistant_turns is not None:
        assert output.metrics["assistant_turns"] == assistant_turns
    else:
        assert len(output.response_ids) <= 60
    full = run_loop(server, tokenizer, scripted, "loop")
    assert full.end_reason == "stop" and full.metrics["assistant_turns"] == 4


@pytest.mark.parametrize(
    "side, check",
    [
        ("left", lambda text: text.startswith("...(truncated)") and text.endswith("gh ")),
        ("right", lambda text: text.startswith("abc") and text.endswith("...(truncated)")),
        ("middle", lambda text: text.startswith("abc") and "...(truncated)..." in text[3:-3] and text.endswith("gh ")),
    ],
)
def test_tool_response_truncation_sides(server, tokenizer, scripted, side, check):
    output = run_loop(
        server,
        tokenizer,
        scripted,
        "echo",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8",
        f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={side}",
        "data.max_response_length=120",
    )
    observation = tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask) if m == 0])
    text = observation.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert check(text), text
    kept = text.replace("...(truncated)...", "").replace("...(truncated)", "")
    assert len(tokenizer.encode(kept)) <= 9
