"""The policy as FSDP2-sharded Ray actors: one process per rank in a ``torch.distributed`` group.

gloo on CPU, NCCL on GPU. Each rank holds a shard of the parameters (``fully_shard`` per decoder
layer, then the root) and works on its slice of the batch; gradients are reduced by FSDP.
``compute_log_prob`` re-scores rollouts (old log-probs), ``update_policy`` takes PPO steps over
micro-batches with gradient accumulation and clipping, ``full_state_dict`` gathers the weights on
rank 0 for the push to the rollout servers.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import ray
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from trainer import algorithms


def response_log_probs(model: torch.nn.Module, batch: TensorDict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens under ``model`` (logits / temperature), ``[b, R]``."""
    responses = batch["responses"]
    length = responses.shape[1]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    logits = logits[:, -length - 1 : -1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    return log_probs, algorithms.entropy_from_logits(logits)


@ray.remote
class FSDPActor:
    """One rank of the policy. ``config`` is the full composed config (``actor_rollout_ref.actor.*``)."""

    def __init__(self, config: DictConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        cuda = torch.cuda.is_available()
        dist.init_process_group(
            "nccl" if cuda else "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=600)
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.rank, self.world_size = rank, world_size
        self.actor = config.actor_rollout_ref.actor
        self.temperature = float(config.actor_rollout_ref.rollout.temperature)
        device = "cuda" if cuda else "cpu"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path, dtype=torch.float32).to(device)
        mesh = init_device_mesh(device, (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.device = device
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=float(self.actor.optim.lr), weight_decay=float(self.actor.optim.weight_decay)
        )
        warmup = int(self.actor.optim.lr_warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup)))

    @torch.no_grad()
    def compute_log_prob(self, batch: TensorDict) -> torch.Tensor:
        """This rank's slice of the batch, re-scored by the current policy (old log-probs)."""
        self.model.eval()
        outputs = [
            response_log_probs(self.model, micro.to(self.device), self.temperature)[0].cpu()
            for micro in batch.split(int(self.actor.ppo_micro_batch_size_per_gpu))
        ]
        return torch.cat(outputs)

    def update_policy(self, batch: TensorDict) -> dict[str, float]:
        """One optimizer step of the PPO loss over this rank's slice, in micro-batches.

        ``batch`` carries ``old_log_probs``, ``advantages`` and ``response_mask`` (plus ``rollout_log_probs``
        when ``actor.rollout_is_threshold`` is set, and ``ref_log_probs`` when ``actor.use_kl_loss``).
        """
        self.model.train()
        micro_batches = batch.split(int(self.actor.ppo_micro_batch_size_per_gpu))
        metrics: dict[str, float] = {}
        self.optimizer.zero_grad()
        for micro in micro_batches:
            micro = micro.to(self.device)
            log_probs, entropy = response_log_probs(self.model, micro, self.temperature)
            mask = micro["response_mask"].float()
            weights = None
            if self.actor.rollout_is_threshold:
                weights, mismatch = algorithms.rollout_importance_weights(
                    micro["old_log_probs"], micro["rollout_log_probs"], mask, float(self.actor.rollout_is_threshold)
                )
                _accumulate(metrics, mismatch, len(micro_batches))
            loss, stats = algorithms.ppo_policy_loss(
                micro["old_log_probs"], log_probs, micro["advantages"], mask,
                float(self.actor.clip_ratio_low), float(self.actor.clip_ratio_high),
                self.actor.clip_ratio_c, self.actor.loss_agg_mode, weights,
            )
            entropy_bonus = algorithms.aggregate_loss(entropy, mask, self.actor.loss_agg_mode)
            total = loss - float(self.actor.entropy_coeff) * entropy_bonus
            if self.actor.use_kl_loss:
                kl = algorithms.kl_penalty(log_probs, micro["ref_log_probs"], self.actor.kl_loss_type)
                kl_loss = algorithms.aggregate_loss(kl, mask, self.actor.loss_agg_mode)
                total = total + float(self.actor.kl_loss_coef) * kl_loss
                stats["kl_loss"] = kl_loss
            (total / len(micro_batches)).backward()
            _accumulate(metrics, {"pg_loss": loss, "entropy": entropy_bonus, **stats}, len(micro_batches))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.actor.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        metrics["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded, on CPU — on rank 0 (other ranks return an empty dict).

        A collective: call it on every rank at once.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def shutdown(self) -> None:
        dist.destroy_process_group()


def _accumulate(metrics: dict[str, float], values: dict[str, Any], count: int) -> None:
    for key, value in values.items():
        metrics[key] = metrics.get(key, 0.0) + float(value.detach() if isinstance(value, torch.Tensor) else value) / count
