"""A rollout manager with two FSDP ranks on its config, for tests that score and train what it generates."""

from __future__ import annotations

from typing import Any, Iterator

import ray
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict

from agentloop import AgentLoopManager
from trainer.fsdp_workers import start_workers
from trainer.micro_batches import split_trajectories, trajectory_sizes
from trainer.settings import rank_settings


def two_ranks(config: DictConfig) -> Iterator[list[Any]]:
    """Yield two FSDP ranks on ``config`` (resolved; a module fixture's body); shut them down and kill them afterwards."""
    OmegaConf.resolve(config)
    workers = start_workers(rank_settings(config), 2, 10, 180)
    yield workers
    ray.get([worker.shutdown.remote() for worker in workers], timeout=60)
    for worker in workers:
        ray.kill(worker)


def manager_and_two_ranks(config: DictConfig) -> Iterator[tuple[AgentLoopManager, list[Any]]]:
    """Yield the manager and its two ranks (a module fixture's body); shut both down afterwards."""
    manager = AgentLoopManager(config)
    actors = start_workers(rank_settings(manager.config), 2, 10, 120)
    yield manager, actors
    ray.get([actor.shutdown.remote() for actor in actors], timeout=60)
    manager.shutdown()


def scores(actors: list[Any], batch: TensorDict) -> torch.Tensor:
    """The ranks' log-probs of ``batch``'s responses, half of the batch's trajectories (with all their rows) on each."""
    halves = split_trajectories(batch, len(trajectory_sizes(batch)) // 2)
    return torch.cat(ray.get([actor.compute_log_prob.remote(half) for actor, half in zip(actors, halves)], timeout=120))
