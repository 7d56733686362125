"""A verl job's config, renamed only: its YAML (``defaults: [ppo_trainer, _self_]`` with verl's search path)
and run script compose through hydra as on the command line, verl's keys are accepted, those that mean
nothing here are named in one warning, and an unknown key fails naming the closest known keys."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from agentloop.config import compose_config, config_keys
from trainer.config_checks import IgnoredKeysWarning, check_config, warn_ignored_keys

REPO = Path(__file__).resolve().parent.parent

# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml, with the search path a parameter
VERL_YAML = """\
hydra:
  searchpath:
    - {searchpath}
defaults:
  - ppo_trainer
  - _self_
data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True
actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""
# verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh, its file paths aside
RUN_SCRIPT = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=256",
    "data.max_prompt_length=1024",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "data.return_raw_chat=True",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
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
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
    "actor_rollout_ref.rollout.multi_stage_wake_up=True",
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.rollout.over_sample_rate=0.1",
    "actor_rollout_ref.rollout.mode=async",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang'",
    "trainer.experiment_name=qwen2.5-3b_baseline",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=20",
    "trainer.val_before_train=True",
    "trainer.total_epochs=15",
    "data.train_files=/nonexistent/gsm8k/train.parquet",
    "data.val_files=/nonexistent/gsm8k/test.parquet",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nonexistent/gsm8k_tool_config.yaml",
]
# what the YAML and the script set that has no meaning here
IGNORED_BY_THE_JOB = {
    "actor_rollout_ref.hybrid_engine": True,
    "actor_rollout_ref.rollout.multi_stage_wake_up": True,
    "actor_rollout_ref.rollout.over_sample_rate": 0.1,
    "global_profiler.tool": "torch_memory",
    "global_profiler.save_path": "./mem_snapshots",
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries": 100000,
    "global_profiler.global_tool_config.torch_memory.stack_depth": 32,
}
SEARCH_PATHS = ["file://verl/trainer/config", "file://agentloop/trainer/config", "pkg://agentloop.conf"]


def write_job(
    directory: Path, searchpath: str = SEARCH_PATHS[0], name: str = "gsm8k_multiturn_grpo", extra: str = ""
) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(VERL_YAML.format(searchpath=searchpath) + extra)
    return name


def compose_job(directory: Path, *overrides: str, **job) -> object:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not available")  # hydra, on verl's absent search path
        return compose_config([*RUN_SCRIPT, *overrides], write_job(directory, **job), config_dir=directory)


@pytest.mark.parametrize("searchpath", SEARCH_PATHS)
def test_a_verl_job_composes_with_any_of_its_search_paths(tmp_path, searchpath):
    config = compose_job(tmp_path / "job", searchpath=searchpath)
    rollout = config.actor_rollout_ref.rollout
    assert "hf" in rollout and "sglang" in rollout, "agentloop's ppo_trainer, not another"
    assert (rollout.name, rollout.n, config.data.train_batch_size, rollout.multi_turn.max_assistant_turns) == (
        "sglang",
        16,
        256,
        5,
    )
    # verl's engine keys reach agentloop's sglang settings
    assert (rollout.sglang.tensor_parallel_size, rollout.sglang.mem_fraction_static) == (1, 0.85)
    assert (
        rollout.log_prob_micro_batch_size_per_gpu == 32
        and config.actor_rollout_ref.ref.fsdp_config.param_offload is True
    )
    assert config_keys().unknown(config) == []


def test_agentloops_ppo_trainer_wins_over_a_verl_checkout_on_the_search_path(tmp_path, monkeypatch):
    verl_config = tmp_path / "verl" / "trainer" / "config"
    verl_config.mkdir(parents=True)
    (verl_config / "ppo_trainer.yaml").write_text("from_verl: 1\n")
    monkeypatch.chdir(tmp_path)  # verl's scripts run from the root of a verl checkout
    config = compose_job(tmp_path / "job")
    assert "from_verl" not in config and config.actor_rollout_ref.rollout.name == "sglang"


def test_the_job_warns_once_naming_every_ignored_key_it_sets(tmp_path):
    config = compose_job(tmp_path / "job")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_config(config)
        assert warn_ignored_keys(config) == IGNORED_BY_THE_JOB
    [warning] = caught
    assert warning.category is IgnoredKeysWarning
    listed = re.findall(r"^  (\S+)=", str(warning.message), flags=re.M)
    assert sorted(listed) == sorted(IGNORED_BY_THE_JOB)


def test_inherited_defaults_warn_nothing_and_always_on_switches_warn_when_off(tmp_path):
    assert config_keys().ignored_settings(compose_config()) == {}
    job = tmp_path / "job"
    (job / "plain.yaml").parent.mkdir()
    (job / "plain.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\n")
    assert config_keys().ignored_settings(compose_config([], "plain", config_dir=job)) == {}
    config = compose_config(["data.return_raw_chat=false", "actor_rollout_ref.rollout.calculate_log_probs=false"])
    with pytest.warns(IgnoredKeysWarning, match=r"data.return_raw_chat=False \(always on here\)"):
        warn_ignored_keys(config)


def test_every_key_of_the_ignored_table_is_accepted_and_reported():
    keys = [key for key, default in config_keys().ignored.items() if default is None]
    assert len(keys) > 300
    settings = config_keys().ignored_settings(compose_config([f"{key}=7" for key in keys]))
    assert settings == {key: 7 for key in keys}
    # verl's free-form mappings take the user's own entries, as in verl
    config = compose_config(["+actor_rollout_ref.rollout.engine_kwargs.trtllm.kv_cache_free_gpu_memory_fraction=0.5"])
    assert config_keys().ignored_settings(config) == {
        "actor_rollout_ref.rollout.engine_kwargs.trtllm.kv_cache_free_gpu_memory_fraction": 0.5
    }


def test_an_unknown_key_fails_naming_the_closest_known_keys(tmp_path):
    with pytest.raises(
        ConfigCompositionException, match=r"(?s)Could not override.*closest known keys.*rollout\.gpu_memory_utilization"
    ):
        compose_config(["actor_rollout_ref.rollout.gpu_memory_utilisation=0.5"])
    with pytest.raises(
        ConfigCompositionException,
        match=r"closest known keys.*actor_rollout_ref\.rollout\.log_prob_micro_batch_size_per_gpu",
    ):
        compose_config(["actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu=8"])
    # hydra merges a YAML's unknown keys silently: agentloop names them
    with pytest.raises(
        ConfigCompositionException,
        match=r"(?s)'trainer\.n_gpu_per_node' is not in agentloop's config.*trainer\.n_gpus_per_node",
    ):
        compose_job(tmp_path / "job", extra="trainer:\n  n_gpu_per_node: 8\n")


def run_trainer(cwd: Path, *arguments: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "trainer.main_ppo", *arguments, f"hydra.run.dir={cwd / 'hydra'}", *flags]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_the_command_line_runs_a_renamed_verl_job_up_to_its_missing_data(tmp_path, model_path):
    name = write_job(tmp_path / "job")
    result = run_trainer(
        tmp_path,
        f"--config-path={tmp_path / 'job'}",
        f"--config-name={name}",
        *RUN_SCRIPT,
        f"actor_rollout_ref.model.path={model_path}",
    )
    assert result.returncode != 0
    assert "data file '/nonexistent/gsm8k/train.parquet' does not exist" in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("IgnoredKeysWarning") == 1
    assert sorted(re.findall(r"^  (\S+)=", result.stderr, flags=re.M)) == sorted(IGNORED_BY_THE_JOB)


def test_the_command_line_names_the_closest_keys_to_an_unknown_one(tmp_path):
    name = write_job(tmp_path / "job")
    result = run_trainer(
        tmp_path,
        f"--config-path={tmp_path / 'job'}",
        f"--config-name={name}",
        "actor_rollout_ref.rollout.gpu_memory_utilisation=0.5",
        flags=("--cfg", "job"),
    )
    assert result.returncode == 1
    assert "Could not override 'actor_rollout_ref.rollout.gpu_memory_utilisation'" in result.stderr
    assert re.search(r"closest known keys .*: actor_rollout_ref\.rollout\.gpu_memory_utilization", result.stderr), (
        result.stderr
    )


def test_a_wheel_carries_the_configs_and_composes_them_without_the_checkout(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the checkout
    for directory in ("agentloop", "trainer", "config"):  # agentloop/conf stays a link to ../config, as checked out
        shutil.copytree(
            REPO / directory, source / directory, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / file, source / file)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {
        "agentloop/conf/__init__.py",
        "agentloop/conf/ppo_trainer.yaml",
        "agentloop/conf/verl_ignored.yaml",
        "agentloop/conf/tools/arithmetic.yaml",
    } <= set(names)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    # the unpacked wheel alone on the path (first, ahead of any editable install), run from elsewhere
    code = (
        "import agentloop.config as c; from agentloop.config import compose_config; "
        "print(c.CONFIG_DIR); print(compose_config(['data.prompt_key=question']).data.prompt_key)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(tmp_path / "site" / "agentloop" / "conf"), "question"]
