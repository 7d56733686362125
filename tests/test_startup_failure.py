"""A rollout server that fails to start fails its manager with the server's error, and the manager leaves
nothing running: its workers (started while the servers load) are killed and its placement group removed.
A transformers internal that breaks the hf engine fails the main job at its servers' start, before any rollout.
Alone in its module, so that no other module's servers hold the CPUs it needs."""

from __future__ import annotations

import time

import pytest
import ray

from agentloop import AgentLoopManager
from agentloop.rows import write_rows
from agentloop.tasks.arithmetic.data import make_rows
from tests.support.config import small_config
from trainer.main_ppo import run


def wait_for_cpus(free: float) -> None:
    deadline = time.monotonic() + 30  # the placement group's CPUs come back once it is removed
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == free


def test_a_server_that_fails_to_start_fails_the_manager_and_leaves_nothing_running(local_ray, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model directory without a model in it
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(ray.exceptions.RayActorError, match="RolloutServer.__init__"):
        AgentLoopManager(
            small_config(
                f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.server_startup_timeout_s=60"
            )
        )
    wait_for_cpus(free)


def test_a_broken_transformers_internal_fails_the_main_job_before_any_rollout(local_ray, tmp_path):
    train = write_rows(make_rows(4), str(tmp_path / "train.jsonl"))
    free = ray.available_resources().get("CPU", 0)
    config = small_config(
        f"data.train_files=[{train}]",
        "data.train_batch_size=2",
        "trainer.total_training_steps=1",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "actor_rollout_ref.rollout.name=tests.support.broken_engines.RaisingAttentionEngine",
    )
    with pytest.raises(ray.exceptions.RayActorError) as failure:
        run(config)
    message = str(failure.value)
    assert "start-up self-test failed with transformers" in message and "attention broken on purpose" in message
    assert "pip install -c constraints.txt" in message
    assert not (tmp_path / "rollouts").exists()  # not one rollout was dumped: none ran
    wait_for_cpus(free)
