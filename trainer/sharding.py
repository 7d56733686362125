"""Loading a model as FSDP2 shards with verl's memory settings (gradient checkpointing, CPU offload), and
clipping gradients wherever those shards keep them.

``fsdp_config.param_offload`` (or ``offload_policy``) is FSDP2's ``CPUOffloadPolicy``: the sharded
parameters, their gradients and so the optimizer state live in CPU memory, each layer is copied to the
GPU for its forward and backward, and the optimizer steps on CPU. ``optimizer_offload`` alone keeps the
parameters on the GPU and parks the optimizer state in CPU memory between updates (``move_optimizer_state``).
On CPU ranks everything already lives in CPU memory: both are accepted and change nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from transformers import AutoConfig

from agentloop.allocator import release_freed_memory
from trainer.rank_settings import FSDPSettings


def load_sharded(
    auto_class: Any,
    path: str,
    mesh: DeviceMesh,
    fsdp: FSDPSettings,
    gradient_checkpointing: bool = False,
    adapt: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """``auto_class.from_pretrained(path)`` sharded per decoder layer (and vision block), then the root, over ``mesh``.

    Only the mesh's first rank reads the checkpoint; the others build the model on the meta device and receive their
    shards from it, so one process per job holds the whole model once, not every rank (at 0.6B parameters in fp32
    a second rank's load peak fell from 3.7 to 2.1 GB: benchmarks/real_size.py). ``adapt`` wraps the model before it is
    sharded (LoRA: ``trainer.lora``); the first rank's new adapter weights are every rank's."""
    first = mesh.get_local_rank() == 0
    if first:
        # loaded on CPU: fully_shard moves each layer to the mesh's device as it shards it (or leaves it on CPU
        # under CPUOffloadPolicy), so no GPU ever holds the whole model
        model = auto_class.from_pretrained(path, dtype=torch.float32, **kwargs)
    else:
        config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=torch.float32, **kwargs)
    if gradient_checkpointing:
        model.config.use_cache = False  # a KV cache is useless in training and incompatible with recomputation
        # non-reentrant: the variant that works with FSDP2's hooks and with inputs that need no gradient
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if adapt is not None:
        model = adapt(model)
    whole = model.state_dict() if first else {}  # the loaded tensors, kept until every rank has its shards
    offload = fsdp.param_offload
    # pinned host memory speeds the copies to the GPU; it needs CUDA
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    precision = MixedPrecisionPolicy(
        param_dtype=getattr(torch, fsdp.param_dtype) if fsdp.param_dtype else None,
        reduce_dtype=getattr(torch, fsdp.reduce_dtype) if fsdp.param_dtype else None,
    )
    for layer in _blocks(model):
        fully_shard(layer, mesh=mesh, offload_policy=policy, mp_policy=precision)
    model = fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=precision)
    if not first:
        model.to_empty(device="cpu" if offload else mesh.device_type)
        if offload:  # fully_shard keeps buffers on the compute device, offloading only the sharded parameters
            for module in model.modules():
                module._buffers = {
                    name: b if b is None else b.to(mesh.device_type) for name, b in module._buffers.items()
                }
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():  # not sharded, and some not in the state dict (rotary frequencies)
        dist.broadcast(buffer, src=dist.get_global_rank(mesh.get_group(), 0), group=mesh.get_group())
    del whole
    release_freed_memory()  # the first rank's whole model, read and freed (see agentloop.allocator)
    return model


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks sharded one by one: decoder layers, and a VLM's vision blocks too."""
    inner = model.get_base_model().model if hasattr(model, "get_base_model") else model.model  # (a PeftModel's)
    if hasattr(inner, "language_model"):
        return [*inner.visual.blocks, *inner.language_model.layers]
    return list(inner.layers)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer's per-parameter tensors (Adam's moments) to ``device``."""
    for state in optimizer.state.values():
        for key, value in state.items():
            # AdamW keeps its step count on CPU unless `capturable`: it stays where it is
            if key != "step" and isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


def clip_grad_norm(
    parameters: Iterator[torch.nn.Parameter], max_norm: float, device: torch.device | str
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, also for gradients kept in CPU memory (``CPUOffloadPolicy``): the
    ranks reduce their norm on ``device``, where their process group's collectives run (NCCL has no CPU)."""
    parameters = list(parameters)
    total = torch.nn.utils.get_total_norm([parameter.grad for parameter in parameters if parameter.grad is not None])
    total = total.to(device)  # a sharded norm keeps its placement: its reduction now happens on `device`
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
