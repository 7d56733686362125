"""Compose agentloop's config (``config/ppo_trainer.yaml``) from Python exactly as the command line does.

The YAML files ship inside the package as ``agentloop.conf`` (the top-level ``config/`` directory, reached
through the ``agentloop/conf`` link in a checkout and copied into a wheel), so hydra finds them as
``pkg://agentloop.conf`` whether agentloop is installed editable, from a wheel, or only on ``PYTHONPATH``.

Importing this module puts that package on hydra's search path after the primary config directory and
before any ``hydra.searchpath`` entry: a user's YAML whose defaults list names ``ppo_trainer`` composes
whatever its search path says (verl's ``file://verl/trainer/config`` included). It also registers the
config's resolvers, which only name places (resolving a config runs nothing; what a config's data and models
need built is its ``task.prepare`` section, run by the command: ``agentloop.preparation``):

- ``${agentloop_config_dir:}``: the config directory, so configs can name their neighbours from anywhere;
- ``${agentloop_cache_dir:}``: agentloop's cache (``$AGENTLOOP_CACHE`` or ``~/.cache/agentloop``), where the
  preparation steps build.

``${agentloop_call:...}`` and ``${agentloop_tiny_model:}``, which ran code while resolving, are gone: they fail
with the way to say the same thing now.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.errors import ConfigCompositionException
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, OmegaConf

from agentloop.config_keys import ConfigKeys

CONFIG_MODULE = "agentloop.conf"
CONFIG_PACKAGE = f"pkg://{CONFIG_MODULE}"
CONFIG_DIR = (Path(__file__).parent / "conf").resolve()


class AgentloopSearchPath(SearchPathPlugin):
    """Adds ``pkg://agentloop.conf`` to every search path composed in this process.

    Registered here rather than found in the ``hydra_plugins`` namespace: hydra cannot list that namespace
    in a setuptools editable install (hydra issue #2359), and an installed plugin would reach into every
    other hydra application of the environment.
    """

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="agentloop", path=CONFIG_PACKAGE)


Plugins.instance().register(AgentloopSearchPath)


def _cache_root() -> Path:
    from agentloop.models.cache import cache_root  # `import agentloop` loads nothing of the models package

    return cache_root()


def _removed(name: str, instead: str) -> Any:
    def fail(*args: Any) -> Any:
        raise ValueError(f"${{{name}:...}} was removed: resolving a config runs no code any more. {instead}")

    return fail


OmegaConf.register_new_resolver("agentloop_config_dir", lambda: str(CONFIG_DIR), replace=True)
OmegaConf.register_new_resolver("agentloop_cache_dir", lambda: str(_cache_root()), replace=True)
OmegaConf.register_new_resolver(
    "agentloop_call",
    _removed(
        "agentloop_call",
        "Name the function as a step under task.prepare (_target_, path, its arguments) and point the key at "
        "${task.prepare.<step>.path}, as config/arithmetic_grpo.yaml does; the command runs the step first.",
    ),
    replace=True,
)
OmegaConf.register_new_resolver(
    "agentloop_tiny_model",
    _removed("agentloop_tiny_model", "ppo_trainer's default actor_rollout_ref.model.path is the tiny model."),
    replace=True,
)


@functools.lru_cache(maxsize=1)
def config_keys() -> ConfigKeys:
    """The key table of agentloop's config: known keys, verl's ignored ones, the closest to a typo."""
    return ConfigKeys.from_dir(CONFIG_DIR)


def composition_message(error: ConfigCompositionException) -> str:
    """What hydra prints for a composition error (its message, then the OmegaConf error under it), plus the
    closest known keys when an override names a key the config lacks."""
    lines = [str(error)]
    if error.__cause__ is not None:
        lines.append(str(error.__cause__))
    match = re.match(r"Could not override '([^']+)'", str(error))
    if match is not None:
        lines.append(config_keys().describe_unknown(match.group(1)))
    return "\n".join(lines)


def check_known_keys(config: DictConfig) -> None:
    """Raise hydra's ``ConfigCompositionException`` for keys neither agentloop nor verl has, which hydra
    lets through when they come from a YAML file rather than the command line."""
    unknown = config_keys().unknown(config)
    if unknown:
        lines = [f"Key {key!r} is not in agentloop's config (nor among verl's accepted keys)" for key in unknown]
        lines += [config_keys().describe_unknown(key) for key in unknown]
        raise ConfigCompositionException("\n".join(lines))


def compose_config(
    overrides: list[str] | None = None, config_name: str = "ppo_trainer", config_dir: str | Path | None = None
) -> DictConfig:
    """Return the composed config with hydra-style ``key=value`` overrides applied.

    ``config_dir``: a directory of the caller's own YAMLs (``--config-path`` on the command line), searched
    first; their defaults lists may name ``ppo_trainer``. Unknown keys fail with the closest known ones named.
    """
    overrides = list(overrides or [])
    try:
        if GlobalHydra.instance().is_initialized():
            if config_dir is not None:
                raise ValueError(
                    "compose_config(config_dir=...) inside a running hydra application: compose there instead"
                )
            config = compose(config_name=config_name, overrides=overrides)
        else:
            context = (
                initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None)
                if config_dir is not None
                else initialize_config_module(CONFIG_MODULE, version_base=None)
            )
            with context:
                config = compose(config_name=config_name, overrides=overrides)
    except ConfigCompositionException as error:
        raise ConfigCompositionException(composition_message(error)) from error
    check_known_keys(config)
    return config
