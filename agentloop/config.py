"""Compose agentloop's config (``config/ppo_trainer.yaml``) from Python exactly as the command line does."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from agentloop.models.tiny_qwen import tiny_model_path

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"

# `${agentloop_tiny_model:}` resolves to the tiny default model's directory, building it on first use.
OmegaConf.register_new_resolver("agentloop_tiny_model", tiny_model_path, replace=True)


def compose_config(overrides: list[str] | None = None, config_name: str = "ppo_trainer") -> DictConfig:
    """Return the composed config with hydra-style ``key=value`` overrides applied."""
    if not CONFIG_DIR.is_dir():
        raise FileNotFoundError(f"config directory {CONFIG_DIR} is missing; install agentloop with `pip install -e .`")
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides or []))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))
