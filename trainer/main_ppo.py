"""GRPO training on agentic rollouts: ``python -m trainer.main_ppo actor_rollout_ref.rollout.mode=async ...``.

One step: rows → ``AgentLoopManager.generate_sequences`` (rollouts, rewards in ``rm_scores``) → old
log-probs on the FSDP ranks → GRPO advantages → one PPO update → full weights pushed to every rollout
server. Metrics go to the console and to ``<trainer.default_local_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf

from agentloop import AgentLoopManager
from agentloop.config import CONFIG_DIR
from agentloop.waiting import wait_for
from trainer import algorithms
from trainer.data import BatchSampler, load_dataset
from trainer.fsdp_actor import FSDPActor


class RayPPOTrainer:
    """Owns the rollout manager and the FSDP policy ranks, and runs the training loop."""

    def __init__(self, config: DictConfig) -> None:
        if config.actor_rollout_ref.rollout.mode != "async":
            raise ValueError("actor_rollout_ref.rollout.mode must be 'async': rollouts run through AgentLoopManager")
        if config.algorithm.adv_estimator != "grpo":
            raise ValueError(f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} is not supported yet; use grpo")
        if not config.data.train_files:
            raise ValueError("data.train_files is empty: name one or more .parquet / .jsonl files")
        self.config = config
        self.rows = load_dataset(list(config.data.train_files) if not isinstance(config.data.train_files, str) else config.data.train_files)
        self.sampler = BatchSampler(len(self.rows), int(config.data.train_batch_size), shuffle=config.data.shuffle, seed=config.data.seed)
        self.world_size = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
        samples = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        if samples % self.world_size:
            raise ValueError(
                f"train_batch_size x rollout.n = {samples} samples do not split over {self.world_size} ranks "
                "(trainer.n_gpus_per_node x trainer.nnodes)"
            )
        self.manager = AgentLoopManager(config)
        port = _free_port()
        address = ray.util.get_node_ip_address() if self.world_size > 1 else "127.0.0.1"
        # One GPU per rank; on CPU the ranks claim no logical CPU, so they never wait behind the servers.
        gpus = 1 if torch.cuda.is_available() else 0
        self.actors = [
            FSDPActor.options(num_gpus=gpus, num_cpus=0).remote(self.manager.config, rank, self.world_size, address, port)
            for rank in range(self.world_size)
        ]
        wait_for(
            [actor.__ray_ready__.remote() for actor in self.actors],
            float(config.trainer.startup_timeout_s),
            f"{self.world_size} policy ranks to start (cluster resources: {ray.cluster_resources()})",
        )
        self.output_dir = Path(config.trainer.default_local_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"

    def _on_ranks(self, method: str, batch: Any) -> list[Any]:
        shards = batch.split(len(batch) // self.world_size)
        calls = [getattr(actor, method).remote(shard) for actor, shard in zip(self.actors, shards)]
        return wait_for(calls, float(self.config.trainer.step_timeout_s), f"{method} on the policy ranks")

    def step(self, indices: list[int]) -> dict[str, float]:
        """One rollout + update + weight push; returns the step's metrics."""
        start = time.perf_counter()
        rollout = self.manager.generate_sequences([self.rows[i] for i in indices])
        tensors = rollout.batch
        mask = tensors["response_mask"].float()
        rewards = tensors["rm_scores"] if "rm_scores" in tensors.keys() else torch.zeros_like(mask)
        advantages, _ = algorithms.grpo_outcome_advantage(
            rewards, mask, list(rollout.non_tensor_batch["uid"]), bool(self.config.algorithm.norm_adv_by_std_in_grpo)
        )
        train = tensors.clone()
        train["old_log_probs"] = torch.cat(self._on_ranks("compute_log_prob", tensors))
        train["advantages"] = advantages
        updates = self._on_ranks("update_policy", train)

        push_start = time.perf_counter()
        state, *_ = wait_for(
            [actor.full_state_dict.remote() for actor in self.actors], float(self.config.trainer.step_timeout_s), "the weight gather"
        )
        self.manager.update_weights(state)
        push_s = time.perf_counter() - push_start

        _, mismatch = algorithms.rollout_importance_weights(train["old_log_probs"], tensors["rollout_log_probs"], mask)
        scores = rewards.sum(-1)
        metrics = {
            "critic/score_mean": float(scores.mean()),
            "response_length/mean": float(tensors["attention_mask"][:, tensors["prompts"].shape[1] :].sum(-1).float().mean()),
            **{f"actor/{key}": float(np.mean([u[key] for u in updates])) for key in updates[0]},
            **{key: float(value) for key, value in mismatch.items()},
            "timing/weight_push_s": push_s,
            "timing/step_s": time.perf_counter() - start,
            "timing/generate_s": rollout.meta_info["timing/generate_sequences_s"],
        }
        return metrics

    def fit(self) -> list[dict[str, float]]:
        """Train for ``trainer.total_training_steps`` steps; return every step's metrics."""
        history = []
        batches = iter(self.sampler)
        with open(self.metrics_path, "a") as log:
            for step in range(1, int(self.config.trainer.total_training_steps) + 1):
                metrics = {"step": step, **self.step(next(batches))}
                log.write(json.dumps(metrics) + "\n")
                log.flush()
                print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in metrics.items()))
                history.append(metrics)
        return history

    def shutdown(self) -> None:
        wait_for([actor.shutdown.remote() for actor in self.actors], 60, "the policy ranks to shut down")
        for actor in self.actors:
            ray.kill(actor)
        self.manager.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def run(config: DictConfig) -> list[dict[str, float]]:
    """Train with a composed config (what ``main`` does after hydra has parsed the command line)."""
    if not ray.is_initialized():
        ray.init(address=config.trainer.ray_address)
    trainer = RayPPOTrainer(config)
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


@hydra.main(config_path=str(CONFIG_DIR), config_name="ppo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    print(OmegaConf.to_yaml(config.trainer))
    run(config)


if __name__ == "__main__":
    main()
