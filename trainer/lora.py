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
from typing import Sequence

import torch
from omegaconf import DictConfig
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from transformers import AutoConfig

from agentloop.models.loading import is_vision_language, model_class
from agentloop.server.adapters import PEFT_PREFIX, PackedAdapter
from agentloop.server.weights import PackedWeights
from agentloop.settings.adapters import (
    DEFAULT_ADAPTER,
    ADAPTERS_KEY,
    AdapterSpec,
    check_adapter_path,
    module_names,
    named_adapters,
)
from agentloop.settings.reading import Section

KEY = "actor_rollout_ref.model"
ADAPTER = DEFAULT_ADAPTER  # PEFT's name of a model's one adapter


@dataclass(frozen=True)
class LoraSettings:
    """verl's LoRA keys of ``actor_rollout_ref.model``: ``lora_rank`` (0: full-weight training), ``lora_alpha``,
    ``target_modules`` (``all-linear``, a list of module names, or a regex), ``exclude_modules`` and
    ``lora_adapter_path`` (a saved PEFT adapter to start from: its own rank, alpha and targets then apply); and
    ``lora_adapters`` (``named``), several named adapters on the one base (``agentloop.settings.adapters``)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    adapter_path: str | None
    named: tuple[AdapterSpec, ...] = ()

    @property
    def enabled(self) -> bool:
        """Whether the policy trains an adapter (as in verl: a rank above 0, or an adapter to start from)."""
        return self.rank > 0 or self.adapter_path is not None or bool(self.named)

    @property
    def several(self) -> bool:
        """Whether the policy has named adapters (``lora_adapters``): each sample trains, and is scored by, its own."""
        return bool(self.named)

    @property
    def adapters(self) -> tuple[AdapterSpec, ...]:
        """Every adapter, in order: ``lora_adapters``, else the one the single-adapter keys describe."""
        if self.named:
            return self.named
        one = AdapterSpec(ADAPTER, self.rank, self.alpha, self.target_modules, self.exclude_modules, self.adapter_path)
        return (one,)

    @classmethod
    def from_section(cls, model: Section) -> LoraSettings:
        """The LoRA settings of ``model`` (the ``actor_rollout_ref.model`` section); an adapter path must hold an
        adapter (checked here, before anything starts)."""
        adapter_path = check_adapter_path(model, "lora_adapter_path")
        return cls(
            rank=model.int("lora_rank", minimum=0, default=0),
            alpha=model.float("lora_alpha", positive=True, default=16),
            target_modules=module_names(model, "target_modules") or "all-linear",
            exclude_modules=module_names(model, "exclude_modules"),
            adapter_path=adapter_path,
            named=named_adapters(model),
        )

    @classmethod
    def from_config(cls, config: DictConfig) -> LoraSettings:
        """Read from the composed config (the trainer's and each rank's edge)."""
        return cls.from_section(Section(config.get("actor_rollout_ref"), "actor_rollout_ref").sub("model"))

    def lora_config(self) -> LoraConfig:
        """The (first) adapter's ``peft`` config."""
        return lora_config(self.adapters[0])

    def adapt(self, model: torch.nn.Module) -> PeftModel:
        """``model`` with its adapters, each loaded from its path or new (``lora_B`` at zero, so the adapted policy
        starts as the base); the first one active, the trainable ones' factors trainable."""
        first, *rest = self.adapters
        if first.path is not None:
            model = PeftModel.from_pretrained(model, first.path, adapter_name=first.name, is_trainable=True)
        else:
            model = get_peft_model(model, lora_config(first), adapter_name=first.name)
        for spec in rest:
            if spec.path is not None:
                model.load_adapter(spec.path, adapter_name=spec.name, is_trainable=spec.trainable)
            else:
                model.add_adapter(spec.name, lora_config(spec))
        if self.several:
            self.activate(model, first.name)
        return model

    def activate(self, model: PeftModel, name: str) -> None:
        """Make ``name`` the adapter the forward pass applies. PEFT's ``set_adapter`` also freezes every other
        adapter: the trainable ones are made trainable again (the optimizer, the checkpoints and FSDP see the same
        parameters throughout); the inactive ones are left out of the pass, so they get no gradient from it."""
        model.set_adapter(name)
        trainable = {spec.name for spec in self.adapters if spec.trainable}
        for layer in model.modules():
            if isinstance(layer, LoraLayer):
                for factors in (layer.lora_A, layer.lora_B):
                    for key, factor in factors.items():
                        factor.requires_grad_(key in trainable)

    def check_model(self, path: str) -> None:
        """Refuse, naming the key, an adapter the model at ``path`` cannot take: a target module it lacks, a rank
        above a layer's width, a module LoRA cannot adapt here (not linear). Builds the model without weights."""
        if not self.enabled:
            return
        if is_vision_language(path):
            raise ValueError(f"{KEY}.lora_rank: LoRA on a vision-language policy is not supported yet; set lora_rank=0")
        for position, spec in enumerate(self.adapters):
            prefix = f"{KEY}.{ADAPTERS_KEY}[{position}]." if self.several else f"{KEY}."
            _check_adapter(spec, path, prefix)


def adapter_indices(settings: LoraSettings, names: Sequence[str | None] | None, rows: int) -> torch.Tensor:
    """Each row's adapter (its ``lora_adapter`` in ``names``; None, or no such column: the first) as its position in
    ``settings.adapters``: the ``adapter_index`` column the ranks train and score each row's adapter by."""
    order = [spec.name for spec in settings.adapters]
    if names is None:
        return torch.zeros(rows, dtype=torch.long)
    unknown = sorted({str(name) for name in names if name and name not in order})
    if unknown:
        raise ValueError(f"samples name LoRA adapters {unknown}, which the policy lacks; it has {order}")
    return torch.tensor([order.index(name) if name else 0 for name in names], dtype=torch.long)


def lora_config(spec: AdapterSpec) -> LoraConfig:
    """An adapter's ``peft`` config: the saved adapter's own, else one from its settings (verl's: no bias)."""
    if spec.path is not None:
        return LoraConfig.from_pretrained(spec.path)
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=_peft_form(spec.target_modules),
        exclude_modules=_peft_form(spec.exclude_modules),
        bias="none",
    )


def _check_adapter(spec: AdapterSpec, path: str, prefix: str) -> None:
    """``check_model`` for one adapter; ``prefix`` starts the keys its errors name."""
    single = prefix == f"{KEY}."
    path_key, rank_key = ("lora_adapter_path", "lora_rank") if single else ("path", "rank")
    key = path_key if spec.path is not None else "target_modules"
    with torch.device("meta"):
        model = model_class(path).from_config(AutoConfig.from_pretrained(path))
    names = [name for name, _ in model.named_modules()]
    if isinstance(spec.target_modules, tuple) and spec.path is None:
        missing = [target for target in spec.target_modules if not _matches(target, names)]
        if missing:
            raise ValueError(
                f"{prefix}target_modules names {missing}, which the model at {path} lacks; {_known(model)}"
            )
    try:
        adapted = get_peft_model(model, lora_config(spec))
    except ValueError as error:
        raise ValueError(f"{prefix}{key}: {error}; {_known(model)}") from None
    layers = [
        (name.removeprefix(PEFT_PREFIX), layer)
        for name, layer in adapted.named_modules()
        if isinstance(layer, LoraLayer)
    ]
    for name, layer in layers:
        if not isinstance(layer, LoraLinear):
            raise ValueError(f"{prefix}{key}: {name} is not a linear layer; adapt linear ones")
    name, layer = min(layers, key=lambda item: min(item[1].in_features, item[1].out_features))
    rank, width = layer.r[ADAPTER], min(layer.in_features, layer.out_features)
    if rank > width:
        rank_key = path_key if spec.path is not None else rank_key
        raise ValueError(
            f"{prefix}{rank_key}: rank {rank} is above the width of {name} "
            f"({layer.in_features} -> {layer.out_features}); set lora_rank to {width} or less"
        )


def gather_adapter(model: PeftModel) -> dict[str, torch.Tensor]:
    """Every adapter's tensors (the frozen ones' too), unsharded on CPU, by the model's parameter names (what
    ``save_pretrained`` takes as its ``state_dict``). A collective: call it on every rank."""
    return {
        name: (parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter).detach().cpu()
        for name, parameter in model.named_parameters()
        if ".lora_A." in name or ".lora_B." in name
    }


def pack_adapter(model: PeftModel, gathered: dict[str, torch.Tensor], name: str = ADAPTER) -> PackedAdapter:
    """The adapter ``name`` of those ``gather_adapter`` returned, ready for the push (PEFT's saved names)."""
    tensors = get_peft_model_state_dict(model, state_dict=gathered, adapter_name=name)
    scalings = {
        module.removeprefix(PEFT_PREFIX): float(layer.scaling[name])
        for module, layer in model.named_modules()
        if isinstance(layer, LoraLayer) and name in layer.scaling
    }
    # sets (target modules) become sorted lists: adapter_config.json as PEFT writes it
    config = json.loads(json.dumps(model.peft_config[name].to_dict(), default=sorted))
    return PackedAdapter(PackedWeights.pack(tensors), scalings, config)


def pack_adapters(model: PeftModel, gathered: dict[str, torch.Tensor]) -> dict[str, PackedAdapter]:
    """Every adapter of a model with several (``lora_adapters``), by name, in the model's order."""
    return {name: pack_adapter(model, gathered, name) for name in model.peft_config}


def save_adapter(model: PeftModel, gathered: dict[str, torch.Tensor], hf_directory: Path) -> None:
    """Save the adapters ``gather_adapter`` returned as verl does: in PEFT's format (``PeftModel.from_pretrained``
    loads it onto the base) in ``lora_adapter`` beside ``hf_directory``, which gets the base model's config. Several
    adapters (``lora_adapters``) go in a folder each, ``lora_adapter/<name>`` (load each with ``adapter_name``)."""
    directory = hf_directory.parent / "lora_adapter"
    if list(model.peft_config) == [ADAPTER]:
        model.save_pretrained(directory, state_dict=gathered)
    else:
        for name, adapter in pack_adapters(model, gathered).items():
            adapter.save(directory / name)
    model.get_base_model().config.save_pretrained(hf_directory)


def _peft_form(names: str | tuple[str, ...] | None) -> str | list[str] | None:
    return list(names) if isinstance(names, tuple) else names


def _matches(target: str, names: list[str]) -> bool:
    """PEFT's rule for a listed target: a module's full name, or its last dotted parts."""
    return any(name == target or name.endswith(f".{target}") for name in names)


def _known(model: torch.nn.Module) -> str:
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    return f"its linear modules are named {linear}"
