"""A sharded model with its optimizer and LR schedule, and the PPO update loop over its mini- and micro-batches."""

from __future__ import annotations

from typing import Any, Callable

import torch
from omegaconf import DictConfig
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from transformers import get_scheduler

from trainer.micro_batches import MicroBatching, is_stand_in, micro_batch_weight, split_trajectories
from trainer.sharding import clip_grad_norm, move_optimizer_state

WARMUP_STYLES = {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr"}


class Trainable:
    """A sharded model with its optimizer and LR schedule (policy or critic); ``role`` (``actor`` or
    ``critic``) prefixes its ``grad_norm`` and ``lr`` metrics.

    ``device`` is where it computes; with ``offload_optimizer`` its optimizer state waits in CPU memory
    between updates (see ``trainer.sharding``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim: DictConfig,
        total_steps: int,
        role: str,
        device: Any = "cpu",
        offload_optimizer: bool = False,
    ) -> None:
        self.model, self.role = model, role
        self.device = device
        # not `device` under CPUOffloadPolicy: the sharded parameters, and so the optimizer state, stay on CPU
        self.parameters_device = next(model.parameters()).device
        self.offload_optimizer = offload_optimizer
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        # frozen parameters (a LoRA policy's base) are neither optimized nor checkpointed
        frozen = len(trained) < len(list(model.parameters()))
        self.state_options = StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None
        self.optimizer = torch.optim.AdamW(trained, lr=float(optim.lr), weight_decay=float(optim.weight_decay))
        style = str(optim.get("warmup_style", "constant"))
        if style not in WARMUP_STYLES:
            raise ValueError(f"optim.warmup_style={style!r}; choose one of {sorted(WARMUP_STYLES)}")
        warmup = int(optim.get("lr_warmup_steps", 0))
        if warmup < 0:
            warmup = int(float(optim.get("lr_warmup_steps_ratio", 0.0)) * total_steps)
        extra = {"min_lr_rate": float(optim.get("min_lr_ratio", 0.0))} if style == "cosine" else {}
        self.scheduler = get_scheduler(
            WARMUP_STYLES[style],
            self.optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            scheduler_specific_kwargs=extra,
        )

    def update(
        self,
        batch: TensorDict,
        config: DictConfig,
        mini_batch_size: int,
        loss: Callable[[TensorDict], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """``config.ppo_epochs`` passes over ``batch`` in mini-batches of ``mini_batch_size`` trajectories (with all
        their rows), one optimizer step each, gradients accumulated over micro-batches of
        ``config.ppo_micro_batch_size_per_gpu`` rows (or ``ppo_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``);
        then one LR-schedule step. Returns metrics averaged over micro-batches (``grad_norm`` over optimizer steps),
        named as ``loss`` names them. A collective: every rank runs as many passes as the others."""
        self.model.train()
        self._optimizer_state_to(self.parameters_device)
        metrics: dict[str, float] = {}
        mini_batches = [
            mini for _ in range(int(config.ppo_epochs)) for mini in split_trajectories(batch, mini_batch_size)
        ]
        lr = self.scheduler.get_last_lr()[0]
        for mini in mini_batches:
            micro_batches = MicroBatching.for_update(config).split(mini, self.device)
            trained = sum(not is_stand_in(micro) for micro in micro_batches)
            for micro in micro_batches:
                value, stats = loss(micro)
                if is_stand_in(micro):  # its passes keep this rank in step with the others; its gradient is 0
                    (value * 0.0).backward()
                    continue
                (value * micro_batch_weight(micro, mini, config.loss_agg_mode)).backward()
                _accumulate(metrics, stats, trained * len(mini_batches))
            grad_norm = clip_grad_norm(self.model.parameters(), float(config.grad_clip), self.device)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            if torch.isfinite(grad_norm):  # a non-finite norm would poison the weights: skip the step
                self.optimizer.step()
            self.optimizer.zero_grad()
            _accumulate(metrics, {f"{self.role}/grad_norm": grad_norm}, len(mini_batches))
        self.scheduler.step()
        self._optimizer_state_to("cpu")
        return {**metrics, f"{self.role}/lr": lr}

    def _optimizer_state_to(self, device: Any) -> None:
        if self.offload_optimizer:
            move_optimizer_state(self.optimizer, device)

    def state(self) -> dict[str, Any]:
        self._optimizer_state_to(self.parameters_device)  # saved beside the parameters (until the next update)
        model, optimizer = get_state_dict(self.model, self.optimizer, options=self.state_options)
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self._optimizer_state_to(self.parameters_device)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self.state_options,
        )
        self.scheduler.load_state_dict(state["scheduler"])


# metrics that combine over micro-batches and ranks as extremes (by their name's suffix), not as means
EXTREMES: dict[str, Callable[..., float]] = {"_max": max, "_min": min}


def _accumulate(metrics: dict[str, float], values: dict[str, Any], count: int) -> None:
    """Add one of ``count`` micro-batches' statistics: the mean over them, but the extremes (``EXTREMES``) of
    them all."""
    for key, value in values.items():
        value = float(value.detach() if isinstance(value, torch.Tensor) else value)
        extreme = EXTREMES.get(key[-4:])
        metrics[key] = extreme(metrics.get(key, value), value) if extreme else metrics.get(key, 0.0) + value / count
