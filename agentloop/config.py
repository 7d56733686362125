"""Compose agentloop's config (``config/ppo_trainer.yaml``) from Python exactly as the command line does."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from agentloop.data.arithmetic import arithmetic_data_path
from agentloop.models.tiny_qwen import tiny_model_path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"

# `${agentloop_tiny_model:}` resolves to the tiny default model's directory, building it on first use.
OmegaConf.register_new_resolver("agentloop_tiny_model", tiny_model_path, replace=True)
# `${agentloop_config_dir:}`: this directory, so configs can name their neighbours from any working directory.
OmegaConf.register_new_resolver("agentloop_config_dir", lambda: str(CONFIG_DIR), replace=True)
# The main job's data and warm-started model, built on first use (see config/arithmetic_grpo.yaml).
OmegaConf.register_new_resolver("agentloop_arithmetic_data", arithmetic_data_path, replace=True)
OmegaConf.register_new_resolver("agentloop_arithmetic_warm_start", lambda: _warm_start(), replace=True)


def _warm_start() -> str:
    from agentloop.models.warm_start import arithmetic_warm_start_path  # it imports this module

    return arithmetic_warm_start_path()


def compose_config(overrides: list[str] | None = None, config_name: str = "ppo_trainer") -> DictConfig:
    """Return the composed config with hydra-style ``key=value`` overrides applied."""
    if not CONFIG_DIR.is_dir():
        raise FileNotFoundError(f"config directory {CONFIG_DIR} is missing; install agentloop with `pip install -e .`")
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides or []))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))
