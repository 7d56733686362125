"""The job's Ray: the cluster it joins, or the local instance it starts with ``ray_kwargs.ray_init``."""

from __future__ import annotations

import os
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf


def ray_address(config: DictConfig) -> str:
    """``trainer.ray_address``; null: a Ray of its own, unless RAY_ADDRESS names one (as ``ray job submit`` does).
    ``ray.init()`` alone would join whatever cluster another job started on this machine."""
    return config.trainer.ray_address or os.environ.get("RAY_ADDRESS") or "local"


def ray_init_kwargs(config: DictConfig) -> dict[str, Any]:
    """``ray_kwargs.ray_init``'s set values, for a Ray instance this job starts (joining a cluster ignores them)."""
    return {key: value for key, value in OmegaConf.to_container(config.ray_kwargs.ray_init).items() if value is not None}


def start_ray(config: DictConfig) -> None:
    """Join or start the job's Ray, unless this process is connected already."""
    if not ray.is_initialized():
        ray.init(address=ray_address(config), **ray_init_kwargs(config))
