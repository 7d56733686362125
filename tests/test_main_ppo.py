"""The trainer through the real stack (FSDP on CPU, one server, the tool agent; the killed run on two ranks): GRPO with
validation, loggers and bypass-mode rollout correction, GAE with a critic and KL, a killed run that
resumes, and config errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from agentloop.cluster import ray_address, ray_init_kwargs
from agentloop.config import compose_config
from agentloop.dumps import read_rollout_dump
from agentloop.rows import write_rows
from agentloop.tasks.arithmetic.data import make_rows
from tests.support.config import small_config
from tests.test_docs import undocumented
from tests.support.runs import signal_at_checkpoint
from trainer.algorithms import adaptive_kl_coef
from trainer.data import BatchSampler
from trainer.main_ppo import run

TOOL_RUN = [
    "data.train_batch_size=2",
    "data.max_prompt_length=512",
    "data.max_response_length=48",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path=config/tools/arithmetic.yaml",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_grpo_steps_in_bypass_mode_with_validation_loggers_and_rollout_dumps(local_ray, tmp_path, capsys):
    train = write_rows(make_rows(8), str(tmp_path / "train.jsonl"))
    val = write_rows(make_rows(2, split="test"), str(tmp_path / "val.parquet"))
    out = tmp_path / "run"
    config = small_config(
        *TOOL_RUN,
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.logger=[console,tensorboard]",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        f"trainer.default_local_dir={out}",
        # bypass mode: no re-scoring pass; REINFORCE with token weights and k1 rejection against the rollout
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=2.0",
    )
    history = run(config)
    assert [line["step"] for line in history] == [0, 1, 2]
    assert read_jsonl(out / "metrics.jsonl") == history
    assert not undocumented(key for line in history for key in line), "docs/reference/metrics.md lacks them"
    assert set(history[0]) == {
        "step",
        "val/score/mean",
        "val/score/arithmetic",
        "timing_s/validation",
        "timing_s/startup",
    }
    assert history[0]["timing_s/validation"] > 0 and history[0]["timing_s/startup"] > 0
    assert (
        "val/score/mean" in history[2] and "val/score/mean" not in history[1] and "timing_s/startup" not in history[1]
    )
    for metrics in history[1:]:
        assert {"timing_s/weight_push", "actor/pg_loss", "actor/lr", "critic/score/mean"} <= set(metrics)
        assert metrics["num_turns/mean"] >= 2
    # step 1 scores the engine's own rollouts with the very same weights (in bypass mode, on the ranks)
    assert history[1]["rollout_corr/abs_log_prob_diff"] < 1e-3
    assert history[1]["rollout_corr/rollout_is_mean"] == pytest.approx(1, abs=1e-3)
    assert history[1]["rollout_corr/rollout_rs_masked_fraction"] == 0
    # the rollout's own metrics reach every logger: console, JSONL (above) and tensorboard
    rollout_keys = {
        "num_turns/mean",
        "tool_call_counts/mean",
        "rollout/cached_token_share",
        "multi_turn/tool_error_rate",
        "timing_s/agent_loop/generate_sequences/max",
        "rollout/requests_per_server/0",
        "prompt_length/mean",
    }
    assert rollout_keys <= set(history[1])
    console = capsys.readouterr().out
    assert all(f"{key}=" in console for key in rollout_keys)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert rollout_keys <= set(events.Tags()["scalars"])
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dump = read_rollout_dump(tmp_path / "rollouts" / "step_000001.parquet")[1]
    assert len(dump) == 4 and all(record["input"].startswith("<|im_start|>system") for record in dump)
    # bypass mode skipped the old-log-prob pass: the old log-probs are the rollout's, bit for bit
    assert all(record["old_log_probs"] == record["rollout_log_probs"] for record in dump)
    order = next(BatchSampler(8, 2, seed=0).batches(1))
    assert sorted({int(record["index"]) for record in dump}) == sorted(order)


def test_gae_with_critic_warmup_and_kl_in_reward_and_loss(local_ray, tmp_path):
    train = write_rows(make_rows(8), str(tmp_path / "train.jsonl"))
    config = small_config(
        *TOOL_RUN,
        f"data.train_files=[{train}]",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.1",
        # k3 is >= 0 per token, so its mean is positive once the policy moves (a k1 sample mean can be < 0)
        "algorithm.kl_penalty=low_var_kl",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
        "trainer.critic_warmup=2",
        "trainer.total_training_steps=3",
        # 2 prompts x 2 samples, one prompt per optimizer step, two epochs: 4 steps per update
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.actor.ppo_epochs=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    first, second, third = run(config)
    assert not undocumented([*first, *second, *third]), "docs/reference/metrics.md lacks them"
    for metrics in (first, second, third):
        assert metrics["critic/vf_loss"] > 0 and metrics["critic/grad_norm"] > 0
    assert not any(key.startswith("actor/pg") for key in first), "step 1 only warms up the critic"
    assert "actor/pg_loss" in second and "actor/kl_loss" in second
    # later mini-batches see a policy already moved away from the one that sampled: off-policy ratios
    assert second["actor/ppo_kl"] != 0
    # the policy equals the reference until its first update (step 2), then drifts away from it
    assert first["actor/reward_kl_penalty"] == pytest.approx(0, abs=1e-6)
    assert second["actor/reward_kl_penalty"] == pytest.approx(0, abs=1e-6)
    assert third["actor/reward_kl_penalty"] > 1e-6
    assert [m["actor/reward_kl_penalty_coeff"] for m in (first, second, third)] == [0.1] * 3, "kl_ctrl.type=fixed"


@pytest.mark.timeout(600)  # its own waits (240 s, then 300 s) come first
def test_killed_run_resumes_at_the_next_step_with_the_same_data_order(local_ray, tmp_path, capsys):
    train = write_rows(make_rows(16), str(tmp_path / "train.jsonl"))
    out, dumps = tmp_path / "run", tmp_path / "rollouts"
    command = [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        *TOOL_RUN,
        f"data.train_files=[{train}]",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.agent.num_workers=0",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.max_actor_ckpt_to_keep=1",
        f"trainer.ray_address={ray.get_runtime_context().gcs_address}",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=4",
        # the tiny random model scores 0 everywhere (no advantage); the entropy bonus still moves the policy,
        # so a resume that failed to restore it, or to push it to the servers, shows as mismatch
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        # the adaptive KL coefficient is trainer state: the resumed run must go on from the checkpointed one
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=8",
        f"trainer.rollout_data_dir={dumps}",
        f"trainer.default_local_dir={out}",
        "hydra.run.dir=" + str(tmp_path / "hydra"),
        *[
            f"actor_rollout_ref.rollout.hf.{key}={value}"
            for key, value in (("num_blocks", 256), ("max_batch_tokens", 1024))
        ],
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    signal_at_checkpoint(command, env, out / "latest_checkpointed_iteration.txt", 2, signal.SIGKILL)

    # the resume runs in this process (what the command line does after parsing it; a second start costs ~10 s)
    run(compose_config([override for override in command[3:] if not override.startswith("hydra.")]))
    resumed = capsys.readouterr().out
    assert "resumed from" in resumed and "global_step_2" in resumed
    history = read_jsonl(out / "metrics.jsonl")
    assert [line["step"] for line in history] == [1, 2, 3, 4]
    assert sorted(path.name for path in out.glob("global_step_*")) == ["global_step_4"]
    # the LR schedule went on where it stopped (linear warmup over 4 steps: 0, 1/4, 2/4, 3/4 of lr)
    lr = 1e-3
    assert [line["actor/lr"] for line in history] == pytest.approx([0, lr / 4, lr / 2, 3 * lr / 4])
    coefs, kls = (
        [line["actor/reward_kl_penalty_coeff"] for line in history],
        [line["actor/reward_kl_penalty"] for line in history],
    )
    assert coefs[0] == 0.1
    for step in (2, 3, 4):  # step 3 is the first after the resume; 4 samples per step
        assert coefs[step - 1] == pytest.approx(adaptive_kl_coef(coefs[step - 2], kls[step - 2], 0.01, 8, 4), rel=1e-9)
    # the servers got the restored policy: the trainer re-scores their rollouts without mismatch
    assert history[2]["rollout_corr/abs_log_prob_diff"] < 1e-3
    # the batches of steps 3 and 4 are those an uninterrupted run takes
    expected = list(BatchSampler(16, 2, seed=0).batches(4))
    for step in (3, 4):
        indices = {int(record["index"]) for record in read_rollout_dump(dumps / f"step_{step:06d}.parquet")[1]}
        assert sorted(indices) == sorted(expected[step - 1])


def test_a_job_starts_a_ray_of_its_own_unless_told_which_to_join(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(compose_config()) == "local"  # not ray.init()'s default: any cluster running on this machine
    assert ray_address(compose_config(["trainer.ray_address=auto"])) == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # as `ray job submit` sets it for its driver
    assert ray_address(compose_config()) == "10.0.0.1:6379"
    assert ray_init_kwargs(compose_config()) == {"include_dashboard": False}
    assert ray_init_kwargs(compose_config(["ray_kwargs.ray_init.num_cpus=4"])) == {
        "include_dashboard": False,
        "num_cpus": 4,
    }


def test_the_command_composes_the_quick_start_without_importing_torch(model_path):
    """``python -m trainer.main_ppo`` starts Ray while a thread prepares and imports the trainer: its own module and
    the composition of a config over ``ppo_trainer`` must not pull in torch, transformers or tensordict first, or Ray
    would wait for them again."""
    code = (
        "import sys; import trainer.main_ppo; from agentloop.config import compose_config; "
        "compose_config(config_name='arithmetic_grpo'); "
        "print(sorted({'torch', 'transformers', 'tensordict'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_config_and_data_errors_are_named(local_ray, tmp_path):
    with pytest.raises(ValueError, match="data.train_files is empty"):
        run(small_config())
    train = write_rows(make_rows(4), str(tmp_path / "t.jsonl"))
    with pytest.raises(
        ValueError,
        match=r"algorithm.adv_estimator='reinforce': .*choose one of \['grpo', 'gae', 'turn_grpo', 'gigpo'\]",
    ):
        run(small_config(f"data.train_files=[{train}]", "algorithm.adv_estimator=reinforce"))
    with pytest.raises(
        ValueError, match=r"algorithm.turn_grpo.normalize='per_step': .*choose one of \['per_turn', 'pooled'\]"
    ):
        run(small_config(f"data.train_files=[{train}]", "algorithm.turn_grpo.normalize=per_step"))
    with pytest.raises(ValueError, match=r"algorithm.gamma=1.5: must be a number in \[0, 1\]; set it between 0 and 1"):
        run(small_config(f"data.train_files=[{train}]", "algorithm.gamma=1.5"))
    with pytest.raises(ValueError, match="algorithm.gigpo.step_weight=-1.0: must be at least 0; set it to 0 or more"):
        run(small_config(f"data.train_files=[{train}]", "algorithm.gigpo.step_weight=-1.0"))
    with pytest.raises(
        ValueError, match=r"algorithm.gigpo.episode_normalize='turns': .*choose one of \['steps', 'trajectories'\]"
    ):
        run(small_config(f"data.train_files=[{train}]", "algorithm.gigpo.episode_normalize=turns"))
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        run(small_config(f"data.train_files=[{train}]", "data.train_batch_size=3", "trainer.n_gpus_per_node=2"))
    with pytest.raises(ValueError, match="algorithm.kl_penalty='k9': is not a known choice; choose one of"):
        run(small_config(f"data.train_files=[{train}]", "algorithm.kl_penalty=k9"))
    with pytest.raises(ValueError, match="need one GPU each, and the Ray cluster has 0; .* or set trainer.device=cpu"):
        run(small_config(f"data.train_files=[{train}]", "data.train_batch_size=2", "trainer.device=cuda"))
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_rs='token_k9'"):
        run(small_config(f"data.train_files=[{train}]", "algorithm.rollout_correction.rollout_rs=token_k9"))
    with pytest.raises(ValueError, match=r"algorithm.kl_ctrl.type='pid': .*choose one of \['fixed', 'adaptive'\]"):
        run(small_config(f"data.train_files=[{train}]", "algorithm.kl_ctrl.type=pid"))
    with pytest.raises(ValueError, match="ppo_mini_batch_size=3 must divide data.train_batch_size=4"):
        run(
            small_config(
                f"data.train_files=[{train}]",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=3",
            )
        )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": [{"role": "user", "content": "hi"}]}\nnot json\n')
    with pytest.raises(ValueError, match="broken.jsonl.*2"):
        run(small_config(f"data.train_files=[{broken}]"))
