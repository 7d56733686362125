"""A 2-step GRPO run through the real stack: two FSDP ranks on CPU, one server, the tool agent."""

from __future__ import annotations

import json

import pytest

from agentloop.data.arithmetic import make_rows, write_rows
from conftest import small_config
from trainer.main_ppo import run


def test_two_grpo_steps_end_to_end(local_ray, tmp_path):
    train = write_rows(make_rows(8), str(tmp_path / "train.jsonl"))
    config = small_config(
        f"data.train_files=[{train}]",
        "data.train_batch_size=2",
        "data.max_prompt_length=512",
        "data.max_response_length=48",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=config/tools/arithmetic.yaml",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    history = run(config)
    assert [metrics["step"] for metrics in history] == [1, 2]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == history
    for metrics in history:
        assert metrics["timing/weight_push_s"] > 0 and metrics["actor/grad_norm"] >= 0
        # step 1 scores the engine's own rollouts with the very same weights
        assert metrics["mismatch/abs_log_prob_diff"] < 1e-3


def test_config_errors_are_named(local_ray, tmp_path):
    with pytest.raises(ValueError, match="data.train_files is empty"):
        run(small_config())
    train = write_rows(make_rows(4), str(tmp_path / "t.jsonl"))
    with pytest.raises(ValueError, match="adv_estimator='gae' is not supported yet"):
        run(small_config(f"data.train_files=[{train}]", "algorithm.adv_estimator=gae"))
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        run(small_config(f"data.train_files=[{train}]", "data.train_batch_size=3"))
