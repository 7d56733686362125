"""Shared fixtures: the real tiny model and a real local Ray instance per test module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from agentloop.config import compose_config
from agentloop.models.tiny_qwen import tiny_model_path

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def model_path() -> str:
    return tiny_model_path()


@pytest.fixture(scope="module")
def local_ray():
    """A fresh local Ray instance for the module (logical CPUs so two servers fit on two cores)."""
    if ray.is_initialized():
        ray.shutdown()
    # workers import test-only tools named in YAML files from this folder
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def small_config(*overrides: str):
    """The default config sized for fast CPU tests."""
    return compose_config(
        [
            "data.max_prompt_length=96",
            "data.max_response_length=24",
            "actor_rollout_ref.rollout.hf.num_blocks=256",
            "actor_rollout_ref.rollout.request_timeout_s=120",
            "actor_rollout_ref.rollout.server_startup_timeout_s=120",
            *overrides,
        ]
    )
