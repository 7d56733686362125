"""verl's GSM8K multi-turn example, run here as a verl user would: verl's YAMLs, run-script overrides,
preprocessed rows, tool, interaction and a custom agent loop (``tests/support/verl_job``), with only the
package renamed and the model path, device counts, ``rollout.name`` and sizes for a CPU changed. The
reward of every sample must be what verl computes for the same response."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ray
from transformers import AutoTokenizer

from agentloop.dumps import read_rollout_dump
from agentloop.reward_score import gsm8k
from tests.support.verl_job import data as verl_data

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests/support/verl_job"

# verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh, key for key, with sizes for a CPU
VERL_RUN_SCRIPT = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=4",
    "data.max_prompt_length=1024",
    "data.max_response_length=48",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "data.return_raw_chat=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "global_profiler.tool=torch_memory",
    "global_profiler.save_path=./mem_snapshots",
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000",
    "global_profiler.global_tool_config.torch_memory.stack_depth=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
    "actor_rollout_ref.rollout.multi_stage_wake_up=True",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.agent.num_workers=0",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.rollout.over_sample_rate=0.1",
    "actor_rollout_ref.rollout.mode=async",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    "trainer.logger=[console]",
    "trainer.project_name=multi-turn-grpo-tiny",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=20",
    "trainer.val_before_train=False",
    "trainer.total_training_steps=1",
]


def run_verl_job(
    tmp_path: Path, config_name: str, *overrides: str, ray_address: str = "local"
) -> subprocess.CompletedProcess:
    """``python -m trainer.main_ppo --config-path ... --config-name ...`` as verl's run scripts call it, on a Ray of its
    own, or joining ``ray_address`` through ``RAY_ADDRESS`` as a job ``ray job submit`` started does (no Ray to start:
    about 10 CPU-seconds less)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "RAY_ADDRESS": ray_address,
    }
    command = [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        f"--config-path={JOB / 'config'}",
        f"--config-name={config_name}",
        *VERL_RUN_SCRIPT,
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        *overrides,
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]
    return result


def dumped_samples(tmp_path: Path) -> list[dict]:
    return read_rollout_dump(tmp_path / "rollouts" / "step_000001.parquet")[1]


def decoded(tokenizer, record: dict) -> str:
    return tokenizer.decode(record["response_ids"], skip_special_tokens=True)


def test_verl_gsm8k_tool_job_runs_with_the_rename_only(local_ray, model_path, tmp_path):
    train = verl_data.write_split(str(tmp_path / "gsm8k"), "tool", "train", 4)
    result = run_verl_job(
        tmp_path,
        "gsm8k_multiturn_grpo",
        f"actor_rollout_ref.model.path={model_path}",
        f"data.train_files={train}",
        f"data.val_files={train}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={JOB / 'config/tool_config/gsm8k_tool_config.yaml'}",
        ray_address=ray.get_runtime_context().gcs_address,
    )
    output = result.stdout + result.stderr
    # keys with no meaning here are accepted and named once, together
    assert output.count("global_profiler.tool") == 1 and "multi_stage_wake_up" in output
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    samples = dumped_samples(tmp_path)
    assert len(samples) == 8
    for record in samples:
        # rows without agent_name run the tool loop (multi_turn.enable); their interaction_kwargs are ignored
        assert record["agent_name"] == "tool_agent" and record["finish_reason"] != "failed"
        truth = record["row"]["reward_model"]["ground_truth"]
        assert record["score"] == gsm8k.compute_score(decoded(tokenizer, record), truth)
        assert record["reward_parts"]["reward_source"] == "reward_function"


def test_verl_gsm8k_interaction_job_with_a_custom_loop_and_reward_function(local_ray, ok_model, tmp_path):
    custom = [
        {**row, "agent_name": agent, "data_source": "mine", "extra_info": {"index": 100 + i}}
        for i, (row, agent) in enumerate(
            zip(verl_data.interaction_rows("train", 2, seed=5), ["verl_style_agent", "single_turn_agent"])
        )
    ]
    train = verl_data.write_split(str(tmp_path / "gsm8k"), "interaction", "train", 2, extra_rows=custom)
    run_verl_job(
        tmp_path,
        "gsm8k_multiturn_grpo_w_interaction",
        f"actor_rollout_ref.model.path={ok_model}",  # answers briefly, so the interaction gets to reply
        f"data.train_files={train}",
        f"data.val_files={train}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={JOB / 'config/interaction_config/gsm8k_interaction_config.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={JOB / 'config/agent_loops.yaml'}",
        f"custom_reward_function.path={JOB / 'reward.py'}",
        "custom_reward_function.name=length_parity_reward",
        "+custom_reward_function.reward_kwargs.bonus=0.5",
        ray_address=ray.get_runtime_context().gcs_address,
    )
    tokenizer = AutoTokenizer.from_pretrained(ok_model)
    samples = dumped_samples(tmp_path)
    assert sorted(record["agent_name"] for record in samples) == sorted(
        ["tool_agent"] * 4 + ["verl_style_agent"] * 2 + ["single_turn_agent"] * 2
    )
    for record in samples:
        assert record["finish_reason"] != "failed", record["extra"]
        # the custom function scores every loop's response, decoded as verl decodes it
        text = decoded(tokenizer, record)
        assert record["score"] == float(len(text) % 2 == 0) + 0.5
        assert record["reward_parts"]["reward_extra_info"]["chars"] == len(text)
        assert record["reward_parts"]["reward_extra_info"]["turns"] == record["num_turns"]
    # the interaction answered the model, and its scores are reported as a part of the reward
    interacted = [record for record in samples if record["agent_name"] == "tool_agent"]
    assert all("interaction" in record["reward_parts"]["reward_parts"] for record in interacted)
    assert any(record["num_turns"] > 2 for record in interacted)
