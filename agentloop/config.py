"""Compose agentloop's config (``config/ppo_trainer.yaml``) from Python exactly as the command line does.

Importing this module registers the generic config resolvers:

- ``${agentloop_tiny_model:}``: the tiny default model's directory, built on first use;
- ``${agentloop_config_dir:}``: the config directory, so configs can name their neighbours from anywhere;
- ``${agentloop_call:pkg.module.function,arg,...}``: the value ``function(arg, ...)`` returns, so a
  config can name what builds its data or model (e.g. ``config/arithmetic_grpo.yaml``) without the
  library knowing the task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


def _tiny_model() -> str:
    from agentloop.models.tiny_qwen import tiny_model_path  # built only when a config asks for it

    return tiny_model_path()


def _call(path: str, *args: Any) -> Any:
    try:
        function = get_method(path)
    except Exception as error:
        raise ValueError(f"${{agentloop_call:{path},...}}: {path!r} is not an importable function: {error}") from error
    return function(*args)


OmegaConf.register_new_resolver("agentloop_tiny_model", _tiny_model, replace=True)
OmegaConf.register_new_resolver("agentloop_config_dir", lambda: str(CONFIG_DIR), replace=True)
OmegaConf.register_new_resolver("agentloop_call", _call, replace=True)


def compose_config(overrides: list[str] | None = None, config_name: str = "ppo_trainer") -> DictConfig:
    """Return the composed config with hydra-style ``key=value`` overrides applied."""
    if not CONFIG_DIR.is_dir():
        raise FileNotFoundError(f"config directory {CONFIG_DIR} is missing; install agentloop with `pip install -e .`")
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(overrides or []))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides or []))
