"""LoRA on the policy with ``peft``: verl's ``actor_rollout_ref.model`` keys, the adapter on the FSDP ranks, and the
adapter as it leaves them (pushed to the servers each step, saved in checkpoints).

With ``lora_rank > 0`` (or ``lora_adapter_path`` set) the ranks load the base model, wrap it in a ``PeftModel`` and
shard it as usual; only the adapter trains. The reference policy for KL is the same model with the adapter
disabled (no second copy of the weights); a push sends the adapter only (``agentloop.server.adapters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
import torch
from omegaconf import DictConfig
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from transformers import AutoConfig

from agentloop.models.loading import is_vision_language, model_class
from agentloop.server.adapters import PEFT_PREFIX, PackedAdapter
from agentloop.server.weights import PackedWeights
from agentloop.settings.reading import Section

KEY = "actor_rollout_ref.model"
ADAPTER = "default"  # PEFT's name of a model's one adapter


@dataclass(frozen=True)
class LoraSettings:
    """verl's LoRA keys of ``actor_rollout_ref.model``: ``lora_rank`` (0: full-weight training), ``lora_alpha``,
    ``target_modules`` (``all-linear``, a list of module names, or a regex), ``exclude_modules`` and
    ``lora_adapter_path`` (a saved PEFT adapter to start from: its own rank, alpha and targets then apply)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    adapter_path: str | None

    @property
    def enabled(self) -> bool:
        """Whether the policy trains an adapter (as in verl: a rank above 0, or an adapter to start from)."""
        return self.rank > 0 or self.adapter_path is not None

    @classmethod
    def from_section(cls, model: Section) -> LoraSettings:
        """The LoRA settings of ``model`` (the ``actor_rollout_ref.model`` section); an adapter path must hold an
        adapter (checked here, before anything starts)."""
        adapter_path = model.optional_str("lora_adapter_path")
        if adapter_path is not None and not (Path(adapter_path) / "adapter_config.json").is_file():
            raise model.error(
                "lora_adapter_path",
                "is not a PEFT adapter directory (no adapter_config.json there)",
                "name a directory written by PeftModel.save_pretrained, e.g. a checkpoint's actor/lora_adapter",
            )
        return cls(
            rank=model.int("lora_rank", minimum=0, default=0),
            alpha=model.float("lora_alpha", positive=True, default=16),
            target_modules=_module_names(model, "target_modules") or "all-linear",
            exclude_modules=_module_names(model, "exclude_modules"),
            adapter_path=adapter_path,
        )

    @classmethod
    def from_config(cls, config: DictConfig) -> LoraSettings:
        """Read from the composed config (the trainer's and each rank's edge)."""
        return cls.from_section(Section(config.get("actor_rollout_ref"), "actor_rollout_ref").sub("model"))

    def lora_config(self) -> LoraConfig:
        """The adapter's ``peft`` config: the saved adapter's own, else one from the keys (verl's: no bias)."""
        if self.adapter_path is not None:
            return LoraConfig.from_pretrained(self.adapter_path)
        return LoraConfig(
            task_type="CAUSAL_LM",
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=_peft_form(self.target_modules),
            exclude_modules=_peft_form(self.exclude_modules),
            bias="none",
        )

    def adapt(self, model: torch.nn.Module) -> PeftModel:
        """``model`` with a trainable adapter (loaded from ``lora_adapter_path``, or new: ``lora_B`` at zero, so
        the adapted policy starts as the base)."""
        if self.adapter_path is not None:
            return PeftModel.from_pretrained(model, self.adapter_path, is_trainable=True)
        return get_peft_model(model, self.lora_config())

    def check_model(self, path: str) -> None:
        """Refuse, naming the key, an adapter the model at ``path`` cannot take: a target module it lacks, a rank
        above a layer's width, a module LoRA cannot adapt here (not linear). Builds the model without weights."""
        if not self.enabled:
            return
        if is_vision_language(path):
            raise ValueError(f"{KEY}.lora_rank: LoRA on a vision-language policy is not supported yet; set lora_rank=0")
        key = "lora_adapter_path" if self.adapter_path is not None else "target_modules"
        with torch.device("meta"):
            model = model_class(path).from_config(AutoConfig.from_pretrained(path))
        names = [name for name, _ in model.named_modules()]
        if isinstance(self.target_modules, tuple) and self.adapter_path is None:
            missing = [target for target in self.target_modules if not _matches(target, names)]
            if missing:
                raise ValueError(
                    f"{KEY}.target_modules names {missing}, which the model at {path} lacks; {_known(model)}"
                )
        try:
            adapted = get_peft_model(model, self.lora_config())
        except ValueError as error:
            raise ValueError(f"{KEY}.{key}: {error}; {_known(model)}") from None
        layers = [
            (name.removeprefix(PEFT_PREFIX), layer)
            for name, layer in adapted.named_modules()
            if isinstance(layer, LoraLayer)
        ]
        for name, layer in layers:
            if not isinstance(layer, LoraLinear):
                raise ValueError(f"{KEY}.{key}: {name} is not a linear layer; adapt linear ones")
        name, layer = min(layers, key=lambda item: min(item[1].in_features, item[1].out_features))
        rank, width = layer.r[ADAPTER], min(layer.in_features, layer.out_features)
        if rank > width:
            rank_key = "lora_adapter_path" if self.adapter_path is not None else "lora_rank"
            raise ValueError(
                f"{KEY}.{rank_key}: rank {rank} is above the width of {name} "
                f"({layer.in_features} -> {layer.out_features}); set lora_rank to {width} or less"
            )


def gather_adapter(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors, unsharded on CPU, by the model's parameter names (what ``save_pretrained`` takes as
    its ``state_dict``). A collective: call it on every rank."""
    return {
        name: (parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter).detach().cpu()
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    }


def pack_adapter(model: PeftModel, gathered: dict[str, torch.Tensor]) -> PackedAdapter:
    """The adapter ``gather_adapter`` returned, ready for the push (PEFT's saved names)."""
    tensors = get_peft_model_state_dict(model, state_dict=gathered, adapter_name=ADAPTER)
    scalings = {
        name.removeprefix(PEFT_PREFIX): float(layer.scaling[ADAPTER])
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer)
    }
    # sets (target modules) become sorted lists: adapter_config.json as PEFT writes it
    config = json.loads(json.dumps(model.peft_config[ADAPTER].to_dict(), default=sorted))
    return PackedAdapter(PackedWeights.pack(tensors), scalings, config)


def save_adapter(model: PeftModel, gathered: dict[str, torch.Tensor], hf_directory: Path) -> None:
    """Save the adapter ``gather_adapter`` returned as verl does: in PEFT's format (``PeftModel.from_pretrained``
    loads it onto the base) in ``lora_adapter`` beside ``hf_directory``, which gets the base model's config."""
    model.save_pretrained(hf_directory.parent / "lora_adapter", state_dict=gathered)
    model.get_base_model().config.save_pretrained(hf_directory)


def _module_names(model: Section, name: str) -> str | tuple[str, ...] | None:
    """A module-name key: one string (``all-linear`` or a regex), or a list of names."""
    value = model.raw(name)
    if value is None or isinstance(value, str):
        return value or None
    return model.strings(name)


def _peft_form(names: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(names) if isinstance(names, tuple) else names


def _matches(target: str, names: list[str]) -> bool:
    """PEFT's rule for a listed target: a module's full name, or its last dotted parts."""
    return any(name == target or name.endswith(f".{target}") for name in names)


def _known(model: torch.nn.Module) -> str:
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return f"its linear modules are named {linear}"
