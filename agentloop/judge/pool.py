"""The judge's servers (``reward_model.*``): a second ``ServerPool`` beside the policy's, frozen (never in a weight
push), supervised the same way.

A generative judge runs on ``RolloutServer``s (the policy's engines, ``reward_model.rollout.name``), without HTTP
fronts of their own (verl's ``reward_router_address`` is the workers', ``agentloop.judge.front``); a discriminative
reward model on ``RewardModelServer``s. Each server takes
``reward_model.rollout.resources_per_server`` in a placement group of its own: its own CPU processes, or GPUs of
its own. What the servers are built from is the judge's own ``JudgeSettings.servers`` (``agentloop.settings.judge``).
"""

from __future__ import annotations

from typing import Callable

import ray

from agentloop.judge.reward_model_server import RewardModelServer
from agentloop.server.rollout_server import RolloutServer
from agentloop.server_pool import ServerPool
from agentloop.settings import JudgeSettings


def start_judge_pool(
    settings: JudgeSettings | None, on_replaced: Callable[[int, ray.actor.ActorHandle], None]
) -> ServerPool | None:
    """The judge's servers, loading (``ServerPool.wait_until_serving``), or None without a judge."""
    if settings is None:
        return None
    server_class = RolloutServer if settings.kind == "generative" else RewardModelServer
    return ServerPool(settings.servers, on_replaced, server_class=server_class)
