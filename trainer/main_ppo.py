"""PPO/GRPO training on agentic rollouts: ``python -m trainer.main_ppo actor_rollout_ref.rollout.mode=async ...``.

A verl job runs as it is with ``verl.trainer.main_ppo`` renamed to ``trainer.main_ppo``: its
``--config-path/--config-name`` YAML's ``defaults: [ppo_trainer, _self_]`` finds agentloop's config
whatever its ``hydra.searchpath`` says, verl's other keys are accepted (those that mean nothing here are
listed in one warning), and an unknown key fails with the closest known keys named.

Before the trainer starts, the command runs the config's preparation (``task.prepare``: the task's data and
warm start, built on the first run, then found in the cache), showing each step.

This module imports little: the preparation and the trainer (``trainer.ray_trainer``, which pulls in torch,
transformers and tensordict) run on a thread while Ray starts, so that neither waits for the other.
"""

from __future__ import annotations

import importlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from agentloop.cluster import start_ray
from agentloop.config import CONFIG_PACKAGE, composition_message
from agentloop.preparation import prepare


def _prepare_and_import(config: DictConfig) -> type:
    # a mistake in the config fails before minutes of preparation (the trainer checks again, and warns)
    importlib.import_module("trainer.config_checks").check_config(config)
    prepare(config)  # the task's data and warm start (task.prepare), built or found in the cache, shown as it goes
    return importlib.import_module("trainer.ray_trainer").RayPPOTrainer


def run(config: DictConfig) -> list[dict[str, Any]]:
    """Train with a composed config (what ``main`` does after hydra has parsed the command line): first its
    preparation steps (``agentloop.preparation``), then the trainer; returns every logged line. Config and data
    errors are raised before any server starts (Ray may be up by then)."""
    with ThreadPoolExecutor(1, thread_name_prefix="trainer-imports") as pool:
        prepared = pool.submit(_prepare_and_import, config)
        start_ray(config)  # on the main thread: a Ray started on another thread did not reach its GCS
        trainer_class = prepared.result()
    trainer, rank_timeout_s = trainer_class(config), 60.0
    try:
        return trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C: the user wants out now, not after a clean rank shutdown
        rank_timeout_s = 5.0
        raise
    finally:
        trainer.shutdown(rank_timeout_s)


@hydra.main(config_path=CONFIG_PACKAGE, config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    print(OmegaConf.to_yaml(config.trainer))
    run(config)


def cli() -> None:
    """``python -m trainer.main_ppo``: hydra's command line, its unknown-key error naming the closest known keys."""
    # hydra prints its errors itself unless told to raise them; raised, the message can be completed here
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except ConfigCompositionException as error:
        sys.exit(composition_message(error))


if __name__ == "__main__":
    cli()
