"""A LoRA adapter on the wire: what a LoRA run pushes each step instead of the policy's weights.

Its tensors keep PEFT's saved names (``base_model.model.<module>.lora_A.weight``) and its config is PEFT's
``adapter_config.json``, so an engine that loads adapters from disk (vLLM) writes both out as they are; an engine
that serves one set of weights (``hf``) merges the adapter into its copy of the base weights with ``merged_into``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from agentloop.server.weights import PackedWeights

PEFT_PREFIX = "base_model.model."  # PEFT's saved names start so; the base model's own name follows
FACTORS = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class PackedAdapter:
    """A LoRA adapter: its ``lora_A``/``lora_B`` tensors by PEFT's saved names, each adapted module's ``scaling``
    (``lora_alpha / r``, as PEFT computed it: per-module rank and alpha patterns and rsLoRA included) by its name
    in the base model, and PEFT's ``adapter_config.json`` contents."""

    weights: PackedWeights
    scalings: dict[str, float]
    config: dict[str, Any]

    def deltas(self) -> dict[str, torch.Tensor]:
        """``<module>.weight`` -> ``scaling x lora_B @ lora_A`` (float32) for every adapted linear module."""
        tensors = self.weights.tensors()
        deltas = {}
        for module, scaling in self.scalings.items():
            down, up = (tensors[f"{PEFT_PREFIX}{module}{factor}"].float() for factor in FACTORS)
            deltas[f"{module}.weight"] = (up @ down) * scaling
        return deltas

    def merged_into(self, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapted modules' weights with the adapter merged: ``base[name] + delta`` in ``base[name]``'s dtype
        (``base`` holds at least every ``<module>.weight`` the adapter adapts)."""
        merged = {}
        for name, delta in self.deltas().items():
            if name not in base:
                raise KeyError(f"the adapter adapts {name!r}, which the served model lacks")
            weight = base[name]
            merged[name] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
        return merged

    def save(self, directory: Path) -> Path:
        """Write the adapter as ``PeftModel.save_pretrained`` does (``adapter_model.safetensors`` and
        ``adapter_config.json``) into ``directory``; returns it."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: tensor.contiguous() for name, tensor in self.weights.tensors().items()},
            directory / "adapter_model.safetensors",
        )
        (directory / "adapter_config.json").write_text(json.dumps(self.config, indent=2))
        return directory

    @classmethod
    def load(cls, directory: Path) -> PackedAdapter:
        """The adapter ``save`` (or ``PeftModel.save_pretrained``) wrote to ``directory``, each module's scaling
        from its config (``lora_alpha / r``; ``/ sqrt(r)`` with rsLoRA). Per-module rank or alpha patterns are
        refused: only PEFT resolves them against the model's module names."""
        from safetensors.torch import load_file

        config = json.loads((directory / "adapter_config.json").read_text())
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(f"{directory}: adapters with rank_pattern or alpha_pattern cannot be read here")
        tensors = load_file(directory / "adapter_model.safetensors")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules = {name[len(PEFT_PREFIX) : -len(FACTORS[0])] for name in tensors if name.endswith(FACTORS[0])}
        return cls(PackedWeights.pack(tensors), dict.fromkeys(sorted(modules), scaling), config)


def served_adapter(adapter: str | None, served: Mapping[str, str]) -> str | None:
    """The engine's name of the pushed LoRA adapter a request names (``served``: each pushed name -> the engine's
    name for it, the first serving requests that name none); None when none was pushed (the base model serves)."""
    if adapter is None:
        return next(iter(served.values()), None)
    if adapter not in served:
        raise ValueError(f"the LoRA adapter {adapter!r} was not pushed to this server; pushed: {list(served)}")
    return served[adapter]
