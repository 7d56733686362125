"""Asynchronous training on real Ray, engines and FSDP ranks: the servers keep generating (a rollout
stream) while the ranks train; every sample is stamped with the policy version that generated it, no sample lags
more than ``async_training.max_staleness`` versions, the importance weights equal a reference computed
here from the dumped log-probs, the reward rises, and a run stopped with Ctrl-C stops in bounded time
and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
from collections import Counter
import signal
import sys
from pathlib import Path

import pytest
import ray
import torch
from tensordict import TensorDict

from agentloop.batch import RolloutBatch, object_array
from agentloop.config import compose_config
from agentloop.dumps import read_rollout_dump
from agentloop.rows import write_rows
from tests.support.config import SMALL, small_config
from tests.support.runs import signal_at_checkpoint
from trainer.config_checks import check_config
from trainer.ray_trainer import RayPPOTrainer
from trainer.async_training import AsyncSettings, staleness_metrics
from trainer.rollout_correction import RolloutCorrection
from trainer.settings import async_settings

REPO = Path(__file__).resolve().parent.parent


def coin_job(coin_model: str, tmp_path, *overrides: str):
    return small_config(*coin_overrides(coin_model, tmp_path, *overrides))


def coin_overrides(coin_model: str, tmp_path, *overrides: str, partial_rollout: bool = False) -> list[str]:
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "agent_name": "single_turn_agent",
            "data_source": "coin",
            "extra_info": {"index": i},
        }
        for i in range(40)
    ]
    train = write_rows(rows, str(tmp_path / "train.jsonl"))
    return [
        f"actor_rollout_ref.model.path={coin_model}",
        f"data.train_files=[{train}]",
        "data.train_batch_size=4",
        "data.shuffle=false",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=16",
        "+custom_reward_function.by_data_source.coin=tests.support.models.says_yes",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        # by default pushes wait between rollouts, so each batch has one version (tests/test_partial_rollouts.py interrupts)
        "async_training.max_staleness=1",
        f"async_training.partial_rollout={str(partial_rollout).lower()}",
        "async_training.group_order=submitted",  # each step trains its own rows (tests/test_dynamic_sampling.py: finish order)
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"trainer.rollout_data_dir={tmp_path / 'run' / 'rollouts'}",
        *overrides,
    ]


def fit(config) -> list[dict]:
    trainer = RayPPOTrainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def test_async_training_overlaps_stamps_versions_corrects_and_resumes(local_ray, coin_model, tmp_path):
    run = tmp_path / "run"
    # a command-line run, stopped with Ctrl-C after its step-3 checkpoint (the servers already generating ahead)
    command = [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        *SMALL,
        *coin_overrides(
            coin_model,
            tmp_path,
            "trainer.total_training_steps=40",
            "trainer.save_freq=3",
            f"trainer.ray_address={ray.get_runtime_context().gcs_address}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    code, output, stopped_s = signal_at_checkpoint(
        command, env, run / "latest_checkpointed_iteration.txt", 3, signal.SIGINT
    )
    assert code != 0 and "KeyboardInterrupt" in output, output[output.index("<<< signal") - 3000 :][:6000]
    print(f"stopped {stopped_s:.1f}s after Ctrl-C")
    assert stopped_s < 60  # the rollout in flight gets 30 s at most, the ranks 5 s
    state = json.loads((run / "global_step_3" / "trainer_state.json").read_text())
    # the stream had taken batches ahead: the rows of those that step 3 had not trained are replayed first
    assert state["sampler_position"] >= 4 and len(state["untrained_rows"]) == 4 * (state["sampler_position"] - 3)
    history = fit(coin_job(coin_model, tmp_path, "trainer.total_training_steps=6", "trainer.resume_mode=auto"))
    # the metrics file's lines up to the checkpoint, then the resumed run's (lines the stopped run logged after it are dropped)
    assert [line["step"] for line in history] == list(range(1, 7))

    for line in history:
        step = line["step"]
        records = read_rollout_dump(run / "rollouts" / f"step_{step:06d}.parquet")[1]
        assert len(records) == 64
        # step s trains version s - 1 on samples of version s - 2 (the previous step's policy), except
        # the first step after a start or a resume, whose batch waited for nothing older
        expected = step - 1 if step in (1, 4) else step - 2
        assert {record["policy_version"] for record in records} == {expected}
        assert line["async/staleness/max"] == line["async/staleness/mean"] == step - 1 - expected
        assert line["async/staleness_histogram/0"] + line["async/staleness_histogram/1"] == 64
        # in submission order a step trains its own rows (unshuffled: 4 a step), though the next step's ran beside them
        assert {int(record["index"]) // 4 for record in records} == {step - 1}
        # the rollout's behaviour policy is the trainer's old policy only when no update came in between
        gap = line["rollout_corr/abs_log_prob_diff"]
        assert gap < 1e-5 if expected == step - 1 else gap > 1e-4
        # the loss's token-level truncated importance weights, against a reference from the dumped log-probs
        for record in records:
            mask = torch.tensor(record["response_mask"]).float()
            ratio = (torch.tensor(record["old_log_probs"]) - torch.tensor(record["rollout_log_probs"])).exp()
            torch.testing.assert_close(
                torch.tensor(record["rollout_is_weights"]), ratio.clamp(max=2.0) * mask, rtol=1e-5, atol=1e-6
            )
        assert 0 <= line["perf/idle_share/ranks"] <= 1 and line["perf/idle_share/servers"] <= 1
    # across the stop and the resume every row was trained once: 16 samples each of the first 6 batches' rows
    trained = Counter(
        int(record["index"])
        for step in range(1, 7)
        for record in read_rollout_dump(run / "rollouts" / f"step_{step:06d}.parquet")[1]
    )
    assert trained == {index: 16 for index in range(24)}
    rewards = [line["critic/score/mean"] for line in history]
    print("mean reward per step:", rewards)
    assert sum(rewards[-2:]) / 2 >= rewards[0] + 0.2, rewards


def test_async_settings_refuse_a_negative_bound_and_fall_back_where_servers_sleep():
    with pytest.raises(ValueError, match=r"async_training.max_staleness=-1: a lag in policy versions"):
        check_config(compose_config(["async_training.max_staleness=-1"]))
    settings = async_settings(compose_config(["async_training.max_staleness=2"]))
    assert settings == AsyncSettings(max_staleness=2)
    with pytest.warns(UserWarning, match="free_cache_engine=true puts them to sleep then .* trains synchronously"):
        assert settings.for_run(True, RolloutCorrection())[0].max_staleness == 0
    assert settings.for_run(False, RolloutCorrection()) == (settings, RolloutCorrection(rollout_is="token"))
    sequence = RolloutCorrection(rollout_is="sequence")
    assert settings.for_run(False, sequence) == (settings, sequence)  # a configured correction is kept
    with pytest.raises(ValueError, match=r"async_training.buffer_groups=3: cannot hold one batch of 4 GRPO groups"):
        check_config(
            compose_config(
                ["async_training.max_staleness=1", "async_training.buffer_groups=3", "data.train_batch_size=4"]
            )
        )
    with pytest.raises(
        ValueError, match=r"async_training.group_order='fifo': .*choose one of \['finished', 'submitted'\]"
    ):
        check_config(compose_config(["async_training.max_staleness=1", "async_training.group_order=fifo"]))


def test_staleness_counts_each_sample_by_its_oldest_token():
    versions = torch.tensor([[3, 3, -1, 4], [4, 4, 4, -1], [-1, -1, -1, -1]])  # -1: observation or padding
    batch = RolloutBatch(
        TensorDict({"rollout_policy_versions": versions}, batch_size=[3]), {"policy_version": object_array([3, 4, 3])}
    )
    metrics = staleness_metrics(batch, trained_version=4, max_staleness=1)
    # lags 1 (oldest token 3), 0, and 1 from the batch's stamp where no token is known; one sample spans two versions
    assert metrics == {
        "async/staleness/mean": pytest.approx(2 / 3),
        "async/staleness/max": 1.0,
        "async/partial_share": pytest.approx(1 / 3),
        "async/staleness_histogram/0": 1.0,
        "async/staleness_histogram/1": 2.0,
    }
    with pytest.raises(RuntimeError, match="lags 2 policy versions, more than async_training.max_staleness=1"):
        staleness_metrics(batch, trained_version=5, max_staleness=1)
