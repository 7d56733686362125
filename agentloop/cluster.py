"""A job's Ray: the cluster it joins, or the local instance it starts with ``ray_kwargs.ray_init`` (the trainer's
command and a bare ``AgentLoopManager`` alike)."""

from __future__ import annotations

import os
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf


def ray_address(config: DictConfig) -> str:
    """``trainer.ray_address``; null: a Ray of its own, unless RAY_ADDRESS names one (as ``ray job submit`` does).
    ``ray.init()`` alone would join whatever cluster another job started on this machine."""
    return OmegaConf.select(config, "trainer.ray_address") or os.environ.get("RAY_ADDRESS") or "local"


def ray_init_kwargs(config: DictConfig) -> dict[str, Any]:
    """``ray_kwargs.ray_init``'s set values, for a Ray instance this job starts (joining a cluster ignores them)."""
    settings = OmegaConf.select(config, "ray_kwargs.ray_init")
    return (
        {key: value for key, value in OmegaConf.to_container(settings).items() if value is not None} if settings else {}
    )


def start_ray(config: DictConfig) -> None:
    """Join or start the job's Ray, unless this process is connected already."""
    if not ray.is_initialized():
        ray.init(address=ray_address(config), **ray_init_kwargs(config))


def check_offered(bundle: dict[str, float], key: str) -> None:
    """Refuse a custom resource no node of the cluster offers, which would leave its actor waiting for a node forever
    (``key``: the setting that names ``bundle``)."""
    offered = ray.cluster_resources()
    missing = sorted(name for name in bundle if name not in ("CPU", "GPU") and name not in offered)
    if missing:
        raise ValueError(
            f"{key} asks for {missing}, which no node of the Ray cluster offers (it has {sorted(offered)}); start the "
            f"nodes meant for it with `ray start --resources='{{\"{missing[0]}\": 8}}'`, or take it out of {key}"
        )


def actor_resources(bundle: dict[str, float], key: str) -> dict[str, Any]:
    """A Ray bundle (``{CPU: 1, GPU: 0, trainer_node: 1}``) named by setting ``key`` as an actor's ``.options()``:
    custom resources place the actor on a node started with them (``ray start --resources``)."""
    check_offered(bundle, key)
    custom = {name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": custom}
