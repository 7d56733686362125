"""Typed settings per config section, read once at the edge from the composed config (hydra/OmegaConf stay the
config system, verl's keys stay as they are): each component is handed its own section's settings, checked where
they are read, so a bad value fails before anything starts, naming its key and the fix.

- ``ServerSettings`` (``server.py``): a pool of rollout servers and their engines (``actor_rollout_ref.rollout``);
- ``RolloutSettings`` (``rollout.py``): the manager, its workers and their loops' sampling;
- ``JudgeSettings`` (``judge.py``): the judge's own (``reward_model.*``), its servers included;
- ``RewardSettings`` (``reward.py``): the reward functions (``custom_reward_function``);
- ``Section`` (``reading.py``): the typed reader they are all built with.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from agentloop.settings.adapters import named_adapters
from agentloop.settings.judge import JudgeSettings
from agentloop.settings.reading import Section
from agentloop.settings.reward import RewardSettings
from agentloop.settings.rollout import ROLLOUT_KEY, AgentSettings, RolloutSettings
from agentloop.settings.server import ServerSettings, lora_rank, lora_target_modules


def rollout_settings(config: DictConfig) -> RolloutSettings:
    """The policy's rollout settings of a composed config (``actor_rollout_ref.rollout``, ``.model.path``), with the
    reward functions its workers score samples with (``custom_reward_function``)."""
    model = Section(config.actor_rollout_ref, "actor_rollout_ref").sub("model")
    settings = RolloutSettings.from_section(Section(config.actor_rollout_ref.rollout, ROLLOUT_KEY), model.str("path"))
    # LoRA runs push adapters: a server that loads them as such (vLLM, SGLang) is launched to take their rank and
    # modules
    rank = lora_rank(model)
    servers = dataclasses.replace(
        settings.servers,
        lora_rank=rank,
        lora_target_modules=lora_target_modules(model) if rank else (),
        lora_adapters=max(1, len(named_adapters(model))),
    )
    return dataclasses.replace(settings, servers=servers, rewards=reward_settings(config))


def reward_settings(config: DictConfig) -> RewardSettings:
    """The reward functions of a composed config (``custom_reward_function``), for each segment's response as the
    batch holds it (``actor_rollout_ref.rollout.response_length``)."""
    response_length = Section(config.actor_rollout_ref.rollout, ROLLOUT_KEY).int("response_length", minimum=1)
    return RewardSettings.from_section(
        Section(config.get("custom_reward_function"), "custom_reward_function"), response_length
    )


def judge_settings(config: DictConfig, policy: ServerSettings) -> JudgeSettings | None:
    """The judge's settings of a composed config (``reward_model``), None when it is off; ``policy``: the policy's
    servers, whose settings a judge's servers start from."""
    return JudgeSettings.from_section(Section(config.get("reward_model"), "reward_model"), policy)


__all__ = [
    "AgentSettings",
    "JudgeSettings",
    "RewardSettings",
    "RolloutSettings",
    "Section",
    "ServerSettings",
    "judge_settings",
    "reward_settings",
    "rollout_settings",
]
