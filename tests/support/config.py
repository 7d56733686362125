"""The default config sized for fast CPU tests."""

from __future__ import annotations

from omegaconf import DictConfig

from agentloop.config import compose_config


# short prompts and responses, a small KV cache and short timeouts (also for command-line runs)
SMALL = [
    "data.max_prompt_length=96",
    "data.max_response_length=24",
    "actor_rollout_ref.rollout.hf.num_blocks=256",
    "actor_rollout_ref.rollout.request_timeout_s=120",
    "actor_rollout_ref.rollout.server_startup_timeout_s=300",  # a loaded machine starts processes slowly
    # the agent loops on an event-loop thread of the test's process (no worker process to start: ~4 CPU-seconds);
    # tests of worker processes (supervision, streaming, several workers) ask for them
    "actor_rollout_ref.rollout.agent.num_workers=0",
    # one FSDP rank: a process fewer to start per trainer (~10 CPU-seconds); tests of what two ranks split ask for two
    "trainer.n_gpus_per_node=1",
]


def small_config(*overrides: str) -> DictConfig:
    """``ppo_trainer`` with ``SMALL``, then ``overrides``."""
    return compose_config([*SMALL, *overrides])
