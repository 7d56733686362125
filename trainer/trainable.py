"""A sharded model with its optimizer and LR schedule, and the PPO update loop over its mini- and micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from transformers import get_scheduler

from agentloop.allocator import release_freed_memory
from trainer.micro_batches import is_stand_in, micro_batch_weight, split_trajectories
from trainer.rank_settings import OptimSettings, UpdateSettings
from trainer.sharding import clip_grad_norm, move_optimizer_state

if TYPE_CHECKING:
    from trainer.lora import LoraSettings

# transformers' schedule of each optim.warmup_style
SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr"}


class Trainable:
    """A sharded model with its optimizer and LR schedule (policy or critic); ``role`` (``actor`` or
    ``critic``) prefixes its ``grad_norm`` and ``lr`` metrics.

    ``device`` is where it computes; with ``offload_optimizer`` its optimizer state waits in CPU memory
    between updates (see ``trainer.sharding``). ``adapters``: a policy with several LoRA adapters (``trainer.lora``),
    whose batches say each row's adapter in ``adapter_index``: each adapter trains on its own rows only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimSettings,
        total_steps: int,
        role: str,
        device: Any = "cpu",
        offload_optimizer: bool = False,
        adapters: LoraSettings | None = None,
    ) -> None:
        self.model, self.role = model, role
        self.adapters = adapters
        self.device = device
        # not `device` under CPUOffloadPolicy: the sharded parameters, and so the optimizer state, stay on CPU
        self.parameters_device = next(model.parameters()).device
        self.offload_optimizer = offload_optimizer
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        # frozen parameters (a LoRA policy's base) are neither optimized nor checkpointed
        frozen = len(trained) < len(list(model.parameters()))
        self.state_options = StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None
        self.optimizer = torch.optim.AdamW(trained, lr=optim.lr, weight_decay=optim.weight_decay)
        # the parameters clipped together: all, or with several adapters each trainable one's (the optimizer's own
        # parameter objects, so found once)
        self._clip_groups = {None: list(model.parameters())} if adapters is None else self._adapter_parameters()
        extra = {"min_lr_rate": optim.min_lr_ratio} if optim.warmup_style == "cosine" else {}
        self.scheduler = get_scheduler(
            SCHEDULES[optim.warmup_style],
            self.optimizer,
            num_warmup_steps=optim.warmup_steps(total_steps),
            num_training_steps=total_steps,
            scheduler_specific_kwargs=extra,
        )

    def update(
        self,
        batch: TensorDict,
        settings: UpdateSettings,
        mini_batch_size: int,
        loss: Callable[[TensorDict], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """``settings.ppo_epochs`` passes over ``batch`` in mini-batches of ``mini_batch_size`` trajectories (with all
        their rows), one optimizer step each, gradients accumulated over ``settings.micro_batching``'s micro-batches
        (``ppo_micro_batch_size_per_gpu`` rows, or ``ppo_max_token_len_per_gpu`` tokens with ``use_dynamic_bsz``);
        then one LR-schedule step. Returns metrics averaged over micro-batches (``grad_norm`` over optimizer steps),
        named as ``loss`` names them. A collective: every rank runs as many passes as the others."""
        self.model.train()
        self._optimizer_state_to(self.parameters_device)
        metrics: dict[str, float] = {}
        mini_batches = [mini for _ in range(settings.ppo_epochs) for mini in split_trajectories(batch, mini_batch_size)]
        lr = self.scheduler.get_last_lr()[0]
        for mini in mini_batches:
            passes = [
                (adapter, rows, settings.micro_batching.split(mini, self.device, rows))
                for adapter, rows in self._passes(mini)
            ]
            trained = sum(not is_stand_in(micro) for *_, micro_batches in passes for micro in micro_batches)
            for adapter, rows, micro_batches in passes:
                if adapter is not None:
                    self.adapters.activate(self.model, adapter)
                share = mini if rows is None else mini[torch.tensor(rows, dtype=torch.long)]
                for micro in micro_batches:
                    value, stats = loss(micro)
                    if is_stand_in(micro):  # its passes keep this rank in step with the others; its gradient is 0
                        (value * 0.0).backward()
                        continue
                    (value * micro_batch_weight(micro, share, settings.loss_agg_mode)).backward()
                    _accumulate(metrics, stats, trained * len(mini_batches))
            _accumulate(metrics, self._clip_and_step(settings.grad_clip), len(mini_batches))
        self.scheduler.step()
        self._optimizer_state_to("cpu")
        # the activations and gradients, freed: not kept in this process while the servers generate (at 0.6B
        # parameters gigabytes per rank; see agentloop.allocator)
        release_freed_memory()
        return {**metrics, f"{self.role}/lr": lr}

    def _passes(self, mini: TensorDict) -> list[tuple[str | None, list[int] | None]]:
        """The adapter and rows of each pass over ``mini``: all rows (None, None), or with several adapters each
        trainable one's rows (every rank runs the same passes in the same order)."""
        if self.adapters is None:
            return [(None, None)]
        return [
            (spec.name, (mini["adapter_index"] == index).nonzero().flatten().tolist())
            for index, spec in enumerate(self.adapters.adapters)
            if spec.trainable
        ]

    def _clip_and_step(self, grad_clip: float) -> dict[str, torch.Tensor]:
        """Clip the gradients (each adapter's on its own, with several: each one's step is its own samples') and
        step, skipping parameters whose norm is not finite; the norms as metrics."""
        norms = {}
        for name, parameters in self._clip_groups.items():
            norm = clip_grad_norm(parameters, grad_clip, self.device)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if not torch.isfinite(norm):  # a non-finite norm would poison the weights: skip their step
                for parameter in parameters:
                    parameter.grad = None
            norms[name] = norm
        self.optimizer.step()  # (parameters without a gradient, an adapter with no sample, are left as they are)
        self.optimizer.zero_grad()
        if self.adapters is None:
            return {f"{self.role}/grad_norm": norms[None]}
        total = torch.stack([norm.float().cpu() for norm in norms.values()]).square().sum().sqrt()
        return {f"{self.role}/grad_norm": total, **{f"{self.role}/grad_norm/{k}": v for k, v in norms.items()}}

    def _adapter_parameters(self) -> dict[str | None, list[torch.nn.Parameter]]:
        names = [spec.name for spec in self.adapters.adapters if spec.trainable]
        return {
            name: [
                p for key, p in self.model.named_parameters() if f".lora_A.{name}." in key or f".lora_B.{name}." in key
            ]
            for name in names
        }

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
