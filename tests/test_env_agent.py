"""env_agent and interactions on a real engine, with a tiny model fine-tuned to answer "ok"."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.env_agent import EnvAgentLoop
from agentloop.agent_loop.tool_agent import ToolAgentLoop
from agentloop.agent_loop.trajectory import observation_delta, state_digest
from agentloop.turn_totals import env_retries_by_kind, turn_scores
from agentloop.rewards import score_output
from agentloop.settings import reward_settings
from agentloop.router import Router
from tests.support.config import small_config

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
INTERACTIONS = "interaction:\n  - name: counter\n    class_name: tests.support.probe_envs.CountingInteraction\n    config: {turns: 3}\n"


@pytest.fixture(scope="module")
def interactions_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("interactions") / "interactions.yaml"
    path.write_text(INTERACTIONS)
    return str(path)


def config(ok_model, interactions_yaml, *overrides):
    return small_config(
        f"actor_rollout_ref.model.path={ok_model}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interactions_yaml}",
        "data.max_response_length=128",
        "actor_rollout_ref.rollout.env.max_turns=4",
        # generous: the exact retry counts below must not pick up a stall of the (niced) Ray worker
        "actor_rollout_ref.rollout.env.step_timeout_s=10",
        *overrides,
    )


@pytest.fixture(scope="module")
def manager(local_ray, ok_model, interactions_yaml):
    manager = AgentLoopManager(config(ok_model, interactions_yaml))
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def server(manager):
    """The manager's rollout server, which the loops below drive through a router of their own."""
    return manager.servers[0]


@pytest.fixture(scope="module")
def tokenizer(ok_model):
    return AutoTokenizer.from_pretrained(ok_model)


def env_row(env: str, **fields):
    return {
        "prompt": [{"role": "user", "content": "start 1"}],
        "agent_name": "env_agent",
        "extra_info": {"env_kwargs": {"class_name": f"tests.support.probe_envs.{env}"}},
        "request_id": f"{env}-{id(fields)}",
        **fields,
    }


def run_env(server, tokenizer, ok_model, interactions_yaml, env, *overrides):
    loop = EnvAgentLoop(
        server_manager=Router([server]), tokenizer=tokenizer, config=config(ok_model, interactions_yaml, *overrides)
    )
    return asyncio.run(loop.run(dict(GREEDY), **env_row(env)))


def mask_runs(output):
    runs, start = [], 0
    mask = output.response_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], output.response_ids[start:i]))
            start = i
    return runs


def assert_exact(output, tokenizer, observations):
    """Model spans are the model's "ok" turns; observation spans are the template's deltas."""
    runs = mask_runs(output)
    assert [value for value, _ in runs] == [1, 0] * len(observations) + [1]
    assert all(tokenizer.decode(ids) == "ok<|im_end|>" for value, ids in runs if value == 1)
    deltas = [observation_delta(tokenizer, [{"role": "user", "content": text}]) for text in observations]
    assert [ids for value, ids in runs if value == 0] == deltas
    assert all(lp == 0.0 for lp, m in zip(output.response_logprobs, output.response_mask) if m == 0)


def test_env_done_at_turn_two(server, tokenizer, ok_model, interactions_yaml):
    output = run_env(server, tokenizer, ok_model, interactions_yaml, "DoneAtTurn2Env")
    assert output.end_reason == "done"
    assert output.metrics["env_steps"] == 2 and output.num_turns == 4
    assert output.reward_parts.env == 1.0  # two steps of info["reward"] = 0.5
    assert [turn.env_reward for turn in output.turns] == [0.5, 0.5] and [turn.reward for turn in output.turns] == [
        0.5,
        0.5,
    ]
    assert [turn.state_key for turn in output.turns] == ["position 0", "position 1"]  # the env's own state_key() hook
    # without a reward function for the row's data source, the env's rewards are the reward
    score = asyncio.run(
        score_output(reward_settings(config(ok_model, interactions_yaml)), tokenizer, {"data_source": "games"}, output)
    )
    assert (
        output.reward_score == 1.0
        and output.reward_parts.by_source() == {"env": 1.0}
        and score.reward_source == "reward_parts"
    )
    assert_exact(output, tokenizer, ["observation 1"])


def test_env_that_never_finishes_stops_at_max_turns(server, tokenizer, ok_model, interactions_yaml):
    output = run_env(server, tokenizer, ok_model, interactions_yaml, "NeverDoneEnv")
    assert output.end_reason == "max_turns" and output.metrics["env_steps"] == 4
    # without a state_key() hook, the text a turn answered names its state: the prompt, then the same observation
    prompt, observation = (
        state_digest(env_row("NeverDoneEnv")["prompt"]),
        state_digest([{"role": "user", "content": "keep going"}]),
    )
    assert [turn.state_key for turn in output.turns] == [prompt] + [observation] * 3 and prompt != observation
    assert_exact(output, tokenizer, ["keep going"] * 3)


def test_observations_exhausting_the_budget_truncate_without_overflow(server, tokenizer, ok_model, interactions_yaml):
    output = run_env(
        server, tokenizer, ok_model, interactions_yaml, "BigObservationEnv", "data.max_response_length=200"
    )
    assert output.end_reason == "length"
    assert len(output.response_ids) <= 200 and output.response_mask[-1] == 1
    assert (
        len(output.response_ids)
        + len(observation_delta(tokenizer, [{"role": "user", "content": "lots of text " * 40}]))
        > 200
    )
    assert_exact(output, tokenizer, ["lots of text " * 40] * (output.metrics["env_steps"] - 1).__int__())


def test_env_failing_every_other_step_is_retried_with_its_recovery_hook(server, tokenizer, ok_model, interactions_yaml):
    output = run_env(server, tokenizer, ok_model, interactions_yaml, "FlakyEnv")
    assert output.end_reason == "done" and output.metrics["env_steps"] == 3
    assert env_retries_by_kind(output.turns) == {"ConnectionError": 2} and output.metrics["env_retries"] == 2
    assert_exact(output, tokenizer, ["step 1", "step 2"])


def test_failed_step_is_retried_after_reset_and_replay(server, tokenizer, ok_model, interactions_yaml):
    output = run_env(server, tokenizer, ok_model, interactions_yaml, "FailsOnceEnv")
    assert output.end_reason == "done"
    assert [turn.env_retries for turn in output.turns] == [
        {},
        {"RuntimeError": 1},
    ]  # the second turn's step failed once
    assert_exact(output, tokenizer, ["history 1 after 1 resets"])


@pytest.mark.parametrize("env, kind", [("AlwaysFailsEnv", "RuntimeError"), ("SlowEnv", "timeout")])
def test_exhausted_retry_budget_ends_cleanly(server, tokenizer, ok_model, interactions_yaml, env, kind):
    # SlowEnv takes 5 s a step: a 0.5 s step timeout makes each try time out
    output = run_env(
        server, tokenizer, ok_model, interactions_yaml, env, "actor_rollout_ref.rollout.env.step_timeout_s=0.5"
    )
    assert output.end_reason == "env_error"
    assert env_retries_by_kind(output.turns) == {kind: 3}  # first try + max_env_retries_per_turn (2)
    assert_exact(output, tokenizer, [])


def test_interaction_terminates_after_k_turns(server, tokenizer, ok_model, interactions_yaml):
    loop = ToolAgentLoop(
        server_manager=Router([server]), tokenizer=tokenizer, config=config(ok_model, interactions_yaml)
    )
    row = {
        "prompt": [{"role": "user", "content": "start 1"}],
        "request_id": "interaction-1",
        "extra_info": {"interaction_kwargs": {"name": "counter"}},
    }
    output = asyncio.run(loop.run(dict(GREEDY), **row))
    assert output.end_reason == "stop"
    assert turn_scores(output.turns) == [0.5, 0.5, 1.0] and [turn.reward for turn in output.turns] == [0.5, 0.5, 1.0]
    assert output.reward_parts.interaction == 3.0 and output.num_turns == 6
    assert_exact(output, tokenizer, ["try again (1)", "try again (2)"])
    with pytest.raises(KeyError, match=r"interaction_kwargs.name='nope' is not among .*\['counter'\]"):
        asyncio.run(loop.run(dict(GREEDY), **{**row, "extra_info": {"interaction_kwargs": {"name": "nope"}}}))


def test_turn_metrics_in_meta_info(manager):
    rows = [env_row("DoneAtTurn2Env"), env_row("FlakyEnv"), env_row("AlwaysFailsEnv")]
    rows.append(
        {
            "prompt": [{"role": "user", "content": "start 2"}],
            "agent_name": "tool_agent",
            "extra_info": {"interaction_kwargs": {"name": "counter", "turns": 2}},
        }
    )
    meta = manager.generate_sequences(rows, validate=True).meta_info
    assert meta["multi_turn/finish_reason/done"] == 2 and meta["multi_turn/finish_reason/env_error"] == 1
    assert meta["multi_turn/finish_reason/stop"] == 1
    assert meta["multi_turn/env_retries/ConnectionError"] == 2 and meta["multi_turn/env_retries/RuntimeError"] == 3
    assert meta["multi_turn/num_turns_histogram"] == {2: 1, 4: 2, 6: 1}
    assert meta["multi_turn/interaction_score/turn_0"] == 0.5 and meta["multi_turn/interaction_score/turn_1"] == 1.0
