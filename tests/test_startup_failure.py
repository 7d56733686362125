"""A rollout server that fails to start fails its manager with the server's error, and the manager leaves
nothing running: its workers (started while the servers load) are killed and its placement group removed.
Alone in its module, so that no other module's servers hold the CPUs it needs."""

from __future__ import annotations

import time

import pytest
import ray

from agentloop import AgentLoopManager
from tests.support.config import small_config


def test_a_server_that_fails_to_start_fails_the_manager_and_leaves_nothing_running(local_ray, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model directory without a model in it
    free = ray.available_resources().get("CPU", 0)
    with pytest.raises(ray.exceptions.RayActorError, match="RolloutServer.__init__"):
        AgentLoopManager(small_config(f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.server_startup_timeout_s=60"))
    deadline = time.monotonic() + 30  # the placement group's CPUs come back once it is removed
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == free
