"""The credit-assignment toy (``agentloop.tasks.corridor``, ``config/corridor_grpo.yaml``, ``benchmarks/credit.py``):
its environment rewards each choice on its own and shows every junction whatever the choices, its rows are
deterministic and fit the configured lengths, its warm-start conversations, and a 2-step GRPO run of the
benchmark's smoke mode through the config."""

from __future__ import annotations

import json
import math
import random

import pytest
from transformers import AutoTokenizer

from agentloop.tasks.corridor.data import SIDES, clue, episode, make_rows
from agentloop.tasks.corridor.env import CorridorEnv, answer_side
from agentloop.tasks.corridor.warm_start import conversation


def build_env(row: dict) -> CorridorEnv:
    env = CorridorEnv(**{key: value for key, value in row["extra_info"]["env_kwargs"].items() if key != "class_name"})
    env.reset()
    return env


def test_each_choice_earns_its_own_reward_and_every_junction_is_walked():
    (row,) = make_rows(1, split="test")
    sides = row["reward_model"]["ground_truth"].split()
    assert len(sides) == 4
    assert row["prompt"][1]["content"] == clue(0, sides) == f"Junction 1 of 4: a draught comes from the {sides[0]}."
    wrong = {"left": "right", "right": "left"}
    choices = [sides[0], wrong[sides[1]], sides[2], "straight on"]  # right, wrong, right, no side at all
    env, observations, rewards = build_env(row), [], []
    for junction, choice in enumerate(choices):
        observation, done, info = env.step(choice)
        assert done == (junction == 3)
        observations.append(env.format_observation(observation) if not done else None)
        rewards.append(info["reward"])
    assert rewards == [0.25, 0.0, 0.25, 0.0]
    assert observations[:3] == [{"role": "user", "content": clue(j, sides)} for j in (1, 2, 3)]
    # the junctions shown do not depend on the choices: an all-right episode sees the same ones, and scores 1
    env = build_env(row)
    steps = [env.step(side) for side in sides]
    assert [env.format_observation(observation) for observation, _, _ in steps[:3]] == observations[:3]
    assert sum(info["reward"] for _, _, info in steps) == 1.0


def test_a_choice_is_the_first_word():
    assert answer_side("left") == "left" and answer_side(" Right.") == "right"
    assert answer_side("right left") == "right"  # naming both sides earns only the first
    assert answer_side("go left") is None and answer_side("") is None and answer_side("lefty") is None


def test_rows_are_deterministic_balanced_and_fit_the_configured_lengths(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path))
    from agentloop.config import compose_config
    from agentloop.preparation import prepare
    from trainer.data import read_rows

    config = compose_config(config_name="corridor_grpo")
    prepare(config, only=["train_data", "val_data"])
    assert config.algorithm.adv_estimator == "grpo" and config.actor_rollout_ref.rollout.n == 8
    train, test = read_rows(str(config.data.train_files[0])), read_rows(str(config.data.val_files[0]))
    assert (len(train), len(test)) == (512, 64) and train == make_rows(512, split="train")
    assert make_rows(4, split="train") != make_rows(4, split="test")
    assert {row["agent_name"] for row in train} == {"env_agent"} and {row["data_source"] for row in train} == {
        "corridor"
    }
    sides = [side for row in train for side in row["reward_model"]["ground_truth"].split()]
    assert sides.count("left") / len(sides) == pytest.approx(0.5, abs=0.03)
    assert all(
        row["reward_model"]["ground_truth"].split() == episode(row["extra_info"]["env_kwargs"]["episode"], 4)
        for row in train
    )
    # the tiny model's tokenizer (the warm start keeps it): prompts, and four answers with their observations, fit
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for row in train + test:
        prompt = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        whole = tokenizer.apply_chat_template(conversation(row, None), tokenize=True, return_dict=False)
        assert (
            len(prompt) <= config.data.max_prompt_length and len(whole) - len(prompt) <= config.data.max_response_length
        )


def test_the_warm_start_conversations_follow_the_clues_then_ignore_them():
    (row,) = make_rows(1, split="warm_start")
    sides = row["reward_model"]["ground_truth"].split()

    def answers(chat: list[dict]) -> list[str]:
        return [message["content"] for message in chat if message["role"] == "assistant"]

    following = conversation(row, None)
    assert answers(following) == sides
    assert [m["content"] for m in following if m["role"] == "user"] == [clue(j, sides) for j in range(4)]
    rng = random.Random(0)
    drawn = [answer for _ in range(64) for answer in answers(conversation(row, rng))]
    assert set(drawn) == set(SIDES) and drawn.count("left") / len(drawn) == pytest.approx(0.5, abs=0.1)


def test_the_benchmark_smoke_run_trains_grpo_through_the_config(local_ray, corridor_model, tmp_path):
    from benchmarks.credit import main

    (row,) = main(["--smoke", "--estimators", "grpo", "--out", str(tmp_path)])
    lines = [json.loads(line) for line in (tmp_path / "grpo-0" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        # 2 prompts x 4 samples, each walking all four junctions (a model turn and an observation each, verl's count)
        assert line["multi_turn/finish_reason/done"] == 8 and line["num_turns/min"] == 8
        assert 0 <= line["critic/score/mean"] <= 1 and math.isfinite(line["actor/pg_loss"])
    # the report: grpo is its own reference, and one of its steps reaches its own final (mean) reward
    assert row["estimator"] == "grpo" and row["final"] == pytest.approx(
        sum(line["critic/score/mean"] for line in lines) / 2
    )
    assert row["steps_to_reference_final"] in (1, 2)
    assert row["ratio"] == 1.0 if math.isfinite(row["steps_to_threshold"]) else math.isnan(row["ratio"])
