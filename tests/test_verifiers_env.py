"""verifiers environments (the real ``verifiers`` package) rolled out unedited by ``verifiers_agent`` on the tiny
models: a multi-turn environment on the "ok" model, a tool environment on the scripted model, each trajectory's tokens
exactly the engine's replies and the template's deltas of the messages the environment added, the reward its rubric's
and its turn rewards its own; an environment that raises, hangs or answers malformed messages fails its sample only,
with its error."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.agent_loop.verifiers_agent import dataset_rows, load_verifiers_env, rollout_input
from agentloop.dumps import mask_runs
from tests.support.config import small_config
from tests.support.external_agents import SCHEMAS
from tests.support.models import SCRIPTS
from tests.test_tool_agent import tool_config

ENV = "tests.support.verifiers_envs"


def verifiers_row(kind: str, prompt: str = "start 1", **spec) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "agent_name": "verifiers_agent",
        "reward_model": {"ground_truth": "5"},
        "extra_info": {"verifiers": {"env_id": ENV, "env_args": {"kind": kind}, **spec}},
    }


@pytest.fixture(scope="module")
def ok_manager(local_ray, ok_model):
    manager = AgentLoopManager(
        small_config(
            f"actor_rollout_ref.model.path={ok_model}",
            "data.max_response_length=128",
            "actor_rollout_ref.rollout.max_failed_sample_ratio=1.0",
            "actor_rollout_ref.rollout.agent.external.timeout_s=15",
        )
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def ok_batch(ok_manager):
    rows = [verifiers_row(kind) for kind in ("counting", "raises", "hangs", "malformed", "counting")]
    long_row = verifiers_row("counting")
    long_row["extra_info"]["verifiers"]["env_args"]["turns"] = 40  # more than data.max_response_length=128 holds
    return ok_manager.generate_sequences([*rows, long_row], validate=True)


def response(batch, i: int) -> tuple[list[int], list[int]]:
    """Sample ``i``'s response ids and loss mask, unpadded."""
    prompt_length = batch.batch["prompts"].shape[1]
    length = int(batch.batch["attention_mask"][i, prompt_length:].sum())
    return batch.batch["responses"][i, :length].tolist(), batch.batch["response_mask"][i, :length].tolist()


def spans(batch, i: int) -> list[tuple[int, list[int]]]:
    ids, mask = response(batch, i)
    return [(value, ids[a:b]) for value, a, b in mask_runs(mask)]


@pytest.mark.parametrize("i", [0, 4])
def test_a_multi_turn_environment_runs_unedited_with_exact_tokens(ok_batch, ok_model, i):
    tokenizer = AutoTokenizer.from_pretrained(ok_model)
    fields = ok_batch.non_tensor_batch
    assert fields["failure"][i] is None
    runs = spans(ok_batch, i)
    # three model turns (max_turns=3), each "ok"; between them the environment's "count n" as the template's delta
    assert [value for value, _ in runs] == [1, 0, 1, 0, 1]
    assert all(tokenizer.decode(ids) == "ok<|im_end|>" for value, ids in runs if value == 1)
    observations = [ids for value, ids in runs if value == 0]
    assert observations == [observation_delta(tokenizer, [{"role": "user", "content": f"count {n}"}]) for n in (1, 2)]
    # the rubric: said_ok (1.0, through the env's parser) + 0.5 * three turns; the env's own reward per turn
    assert fields["reward_score"][i] == 2.5 and fields["reward_source"][i] == "agent_loop"
    assert fields["reward_extra_info"][i]["verifiers/said_ok"] == 1.0
    assert [turn.env_reward for turn in fields["turns"][i]] == [0.25, 0.5, 0.75]
    assert fields["metrics"][i]["env_steps"] == 3 and fields["metrics"][i]["gateway_calls"] == 3


@pytest.mark.parametrize(
    ("i", "error"),
    [
        (1, r"KeyError: .the environment's own bug"),
        (2, r"TimeoutError: the verifiers environment's rollout ran past .*external.timeout_s=15s after 1 model call"),
        (3, r"RuntimeError: the verifiers environment's rollout ended on an error: ModelError"),
    ],
)
def test_an_environment_that_raises_hangs_or_answers_malformed_messages_fails_its_sample_only(ok_batch, i, error):
    fields = ok_batch.non_tensor_batch
    assert fields["end_reason"][i] == "failed"
    assert fields["failure"][i] is not None
    assert re.search(error, fields["failure"][i].error), fields["failure"][i].error
    assert ok_batch.batch["response_mask"][i].sum() == 0
    assert ok_batch.meta_info["rollout/failed_samples"] == 3


def test_the_row_is_the_environments_rollout_input():
    row = verifiers_row("counting", task="count", info=json.dumps({"k": 1}))
    row["extra_info"]["index"] = 7
    assert rollout_input(row) == {
        "prompt": [{"role": "user", "content": "start 1"}],
        "example_id": 7,
        "task": "count",
        "answer": "5",
        "info": '{"k": 1}',
    }


def test_the_environments_dataset_as_rows():
    rows = dataset_rows(ENV, {"kind": "counting", "question": "start 2", "answer": "7"})
    assert rows == [
        {
            "data_source": f"verifiers/{ENV}",
            "agent_name": "verifiers_agent",
            "prompt": [{"role": "user", "content": "start 2"}],
            "reward_model": {"ground_truth": "7"},
            "extra_info": {
                "index": 0,
                "verifiers": {
                    "env_id": ENV,
                    "env_args": {"kind": "counting", "question": "start 2", "answer": "7"},
                    "task": "default",
                    "info": None,
                },
            },
        }
    ]
    assert load_verifiers_env(ENV, {"kind": "counting", "question": "start 2", "answer": "7"}) is load_verifiers_env(
        ENV, {"answer": "7", "kind": "counting", "question": "start 2"}
    )


def test_an_environment_that_cannot_load_is_named():
    with pytest.raises(ValueError, match=r"verifiers environment 'no_such_env_package' .* cannot be loaded"):
        load_verifiers_env("no_such_env_package")


@pytest.fixture(scope="module")
def tool_batch(local_ray, scripted_model):
    manager = AgentLoopManager(tool_config(scripted_model))
    try:
        # the row offers the scripted model the tools it was trained with (verifiers' per-example info.oai_tools)
        row = verifiers_row("tools", prompt="script multi", info=json.dumps({"oai_tools": SCHEMAS}))
        yield manager.generate_sequences([row], validate=True)
    finally:
        manager.shutdown()


def test_a_tool_environment_runs_unedited_with_exact_tokens(tool_batch, scripted_model):
    tokenizer = AutoTokenizer.from_pretrained(scripted_model.path)
    fields = tool_batch.non_tensor_batch
    assert fields["failure"][0] is None, fields["failure"][0]
    runs = spans(tool_batch, 0)
    assert [value for value, _ in runs] == [1, 0, 1, 0, 1]
    replies = [tokenizer.decode(ids) for value, ids in runs if value == 1]
    assert replies == [f"{turn}<|im_end|>" for turn in SCRIPTS["multi"]]
    # the environment's own tools answered: the calculator's 5, then its submit_answer's verdict
    results = [[{"role": "tool", "content": "5"}], [{"role": "tool", "content": "correct"}]]
    assert [ids for value, ids in runs if value == 0] == [observation_delta(tokenizer, r) for r in results]
    assert [call.result for turn in fields["turns"][0] for call in turn.calls] == ["5", "correct"]
    assert fields["reward_score"][0] == 1.0 and fields["reward_extra_info"][0]["verifiers/submitted_correct"] == 1.0
    assert fields["end_reason"][0] == "stop"


def test_the_quick_start_environments_rows_round_trip_through_parquet(tmp_path):
    import pyarrow.parquet as pq

    from agentloop.rows import write_rows

    rows = dataset_rows("examples.verifiers_arithmetic", {"train": 4}, n=4)
    assert [message["role"] for message in rows[0]["prompt"]] == ["system", "user"]
    assert json.loads(rows[0]["extra_info"]["verifiers"]["info"])["oai_tools"][0]["function"]["name"] == "calculator"
    read = pq.read_table(write_rows(rows, str(tmp_path / "train.parquet"))).to_pylist()
    assert [rollout_input(row) for row in read] == [rollout_input(row) for row in rows]


def test_a_rollout_the_token_budget_stops_keeps_its_trajectory_and_is_scored(ok_batch):
    fields = ok_batch.non_tensor_batch
    assert fields["failure"][5] is None and fields["end_reason"][5] == "length"
    turns = fields["turns"][5]
    assert 3 < len(turns) < 40 and len(response(ok_batch, 5)[0]) <= 128
    # the gateway refused the call past the budget; the environment's rubric scored the turns before it
    assert fields["reward_score"][5] == 1.0 + 0.5 * len(turns)
    assert [turn.env_reward for turn in turns] == [0.25 * n for n in range(1, len(turns) + 1)]
