"""The judge's servers (``reward_model.*``): a second ``ServerPool`` beside the policy's, frozen (never in a weight
push), supervised the same way.

A generative judge runs on ``RolloutServer``s (the policy's engines, ``reward_model.rollout.name``), without HTTP
fronts of their own (verl's ``reward_router_address`` is the workers', ``agentloop.judge.front``); a discriminative
reward model on ``RewardModelServer``s. Each server takes
``reward_model.rollout.resources_per_server`` in a placement group of its own: its own CPU processes, or GPUs of
its own.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

import ray
from omegaconf import DictConfig

from agentloop.judge.reward_model_server import RewardModelServer
from agentloop.server.rollout_server import RolloutServer
from agentloop.server_pool import ServerPool

KINDS = ("generative", "discriminative")


def judge_kind(config: DictConfig) -> str:
    """``reward_model.kind``, with ``auto`` read from the checkpoint: discriminative for a sequence-classification
    architecture (verl's reward models), else generative."""
    settings = config.reward_model
    if settings.kind != "auto":
        return str(settings.kind)
    manifest = Path(str(settings.model.path or config.actor_rollout_ref.model.path)) / "config.json"
    architectures = json.loads(manifest.read_text()).get("architectures") or [] if manifest.is_file() else []
    return (
        "discriminative" if any(name.endswith("ForSequenceClassification") for name in architectures) else "generative"
    )


def judge_server_config(config: DictConfig) -> DictConfig:
    """The config the judge's servers are built from: the policy's, with the judge's model and ``reward_model.rollout``
    settings in ``actor_rollout_ref``'s places (ports past the policy servers')."""
    settings, policy = config.reward_model, config.actor_rollout_ref.rollout
    if settings.kind not in KINDS:
        raise ValueError(f"reward_model.kind={settings.kind!r}: choose one of {list(KINDS)}")
    if settings.kind == "discriminative" and not settings.model.path:
        raise ValueError(
            "reward_model.kind=discriminative needs reward_model.model.path (a sequence-classification checkpoint)"
        )
    derived = copy.deepcopy(config)
    derived.actor_rollout_ref.model.path = settings.model.path or config.actor_rollout_ref.model.path
    rollout = derived.actor_rollout_ref.rollout
    rollout.name = settings.rollout.name or policy.name
    for key in ("data_parallel_size", "resources_per_server", "prompt_length", "response_length"):
        rollout[key] = settings.rollout[key]
    rollout.max_model_len = None
    for backend in ("sglang", "vllm"):  # launched on ports past the policy servers' (or any free one), never attached
        rollout[backend].urls = []
        if policy[backend].port:
            rollout[backend].port = int(policy[backend].port) + int(policy.data_parallel_size)
    rollout.http.enable = False  # the workers reach it through their routers, HTTP calls too (agentloop.judge.front)
    return derived


def start_judge_pool(
    config: DictConfig, on_replaced: Callable[[int, ray.actor.ActorHandle], None]
) -> ServerPool | None:
    """The judge's servers, loading (``ServerPool.wait_until_serving``), or None when ``reward_model.enable`` is off.
    Sets ``config.reward_model.kind`` to the kind served (``auto`` resolved), which the workers read."""
    if not config.reward_model.enable:
        return None
    config.reward_model.kind = judge_kind(config)
    server_class = RolloutServer if config.reward_model.kind == "generative" else RewardModelServer
    return ServerPool(
        judge_server_config(config),
        on_replaced,
        server_class=server_class,
        role="judge server",
        section="reward_model.rollout",
    )
