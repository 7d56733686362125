"""Configuration mistakes, named before anything starts; the one warning about verl keys that mean nothing
here; and the FSDP rank count the checks use."""

from __future__ import annotations

import warnings

from omegaconf import DictConfig

from agentloop.config import check_known_keys, config_keys
from agentloop.config_keys import ALWAYS_ON
from agentloop.settings import judge_settings, rollout_settings
from agentloop.settings.adapters import ENGINES_WITH_SEVERAL
from trainer.lora import LoraSettings
from trainer.settings import (
    AlgorithmSettings,
    RunSettings,
    async_settings,
    group_filter,
    rank_settings,
    rollout_correction,
)


class IgnoredKeysWarning(UserWarning):
    """A run sets verl keys that have no meaning in agentloop (``config/verl_ignored.yaml``)."""


def world_size(config: DictConfig) -> int:
    """FSDP ranks: ``trainer.n_gpus_per_node x trainer.nnodes``."""
    return int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)


def check_config(config: DictConfig) -> None:
    """Raise ``ValueError`` naming the first setting the trainer cannot run with (hydra's
    ``ConfigCompositionException`` for a key agentloop does not know)."""
    check_known_keys(config)
    # the rollout side's sections, checked where they are read (agentloop.settings)
    judge_settings(config, rollout_settings(config).servers)
    # the trainer's own sections, likewise (trainer.settings): its run, its ranks (actor, reference, critic), the
    # rollout correction, dynamic sampling with the overlong penalty, async training
    RunSettings.from_config(config)
    _check_lora(config)
    rank_settings(config)
    rollout_correction(config)
    group_filter(config)
    async_settings(config)
    algorithm = AlgorithmSettings.from_config(config)
    _check_generation_batch(config)
    if not config.data.train_files:
        raise ValueError("data.train_files is empty: name one or more .parquet / .jsonl files")
    ranks = world_size(config)
    samples = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
    if samples % ranks:
        raise ValueError(
            f"train_batch_size x rollout.n = {samples} samples do not split over {ranks} ranks "
            "(trainer.n_gpus_per_node x trainer.nnodes)"
        )
    if int(config.trainer.critic_warmup) > 0 and algorithm.adv_estimator != "gae":
        raise ValueError(
            "trainer.critic_warmup needs a critic to warm up: set algorithm.adv_estimator=gae, or critic_warmup=0"
        )
    for name, section in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor), ("critic", config.critic)):
        mini = section.ppo_mini_batch_size
        if mini and (
            int(config.data.train_batch_size) % int(mini) or int(mini) * int(config.actor_rollout_ref.rollout.n) % ranks
        ):
            raise ValueError(
                f"{name}.ppo_mini_batch_size={mini} must divide data.train_batch_size={config.data.train_batch_size}, "
                f"and its {int(mini) * int(config.actor_rollout_ref.rollout.n)} samples (x rollout.n) must split over {ranks} ranks"
            )


def _check_lora(config: DictConfig) -> None:
    """LoRA's keys (``trainer.lora``); every engine takes adapter pushes (``Engine.update_adapter``). The model's own
    fit is checked once it is built (``check_model``)."""
    settings = LoraSettings.from_config(config)
    engine = config.actor_rollout_ref.rollout.name
    if settings.several and engine not in ENGINES_WITH_SEVERAL:
        raise ValueError(
            f"actor_rollout_ref.model.lora_adapters is set, and actor_rollout_ref.rollout.name={engine} serves one "
            "adapter at a time (hf merges it into its weights); named adapters need an engine that serves them side "
            f"by side, each request naming its own: set rollout.name to one of {list(ENGINES_WITH_SEVERAL)}, or use "
            "the single-adapter keys (lora_rank, lora_adapter_path) with lora_adapters=null"
        )
    sync = config.actor_rollout_ref.rollout.get("weight_sync", "object_store")
    if settings.enabled and sync != "object_store":
        raise ValueError(
            f"actor_rollout_ref.rollout.weight_sync={sync}: with LoRA each push is the adapter alone (megabytes), sent "
            "through Ray's object store; set weight_sync=object_store, or lora_rank=0 to push full weights"
        )


def _check_generation_batch(config: DictConfig) -> None:
    """``data.gen_batch_size``: only with dynamic sampling."""
    generation, batch = config.data.gen_batch_size, int(config.data.train_batch_size)
    if generation is not None and int(generation) <= 0:
        raise ValueError(f"data.gen_batch_size={generation} must be positive (rows per generation batch), or null")
    if generation is not None and int(generation) != batch and not config.algorithm.filter_groups.enable:
        raise ValueError(
            f"data.gen_batch_size={generation} differs from data.train_batch_size={batch}: a generation batch of another "
            "size needs dynamic sampling (algorithm.filter_groups.enable=true), which keeps train_batch_size of its groups"
        )


def warn_ignored_keys(config: DictConfig) -> dict[str, object]:
    """Warn once, naming every verl key this config sets that agentloop ignores; return them by key."""
    settings = config_keys().ignored_settings(config)
    if settings:
        lines = [
            f"  {key}={value}" + (" (always on here)" if value is False and key in ALWAYS_ON else "")
            for key, value in settings.items()
        ]
        warnings.warn(
            f"agentloop ignores {len(settings)} verl key(s) this run sets; they have no meaning here "
            "(why: config/verl_ignored.yaml):\n" + "\n".join(lines),
            IgnoredKeysWarning,
            stacklevel=2,
        )
    return settings
