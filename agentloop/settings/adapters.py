"""Several LoRA adapters on one base (``actor_rollout_ref.model.lora_adapters``): their names and settings, read once
for the rollout side (which adapter a sample uses, what the servers load) and the trainer (``trainer.lora``).

Each entry is ``{name, rank, alpha, target_modules, exclude_modules, path, trainable}``; what an entry leaves out it
takes from the single-adapter keys (``lora_rank``, ``lora_alpha``, ``target_modules``, ``exclude_modules``). Without
the list the single-adapter keys describe one adapter, named ``default`` (PEFT's name for a model's one adapter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agentloop.settings.reading import Section

DEFAULT_ADAPTER = "default"
ADAPTERS_KEY = "lora_adapters"
ENGINES_WITH_SEVERAL = ("vllm", "sglang")  # serve several adapters side by side, each request naming its own
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_FIELDS = {"name", "rank", "alpha", "target_modules", "exclude_modules", "path", "trainable"}


@dataclass(frozen=True)
class AdapterSpec:
    """One named adapter: its rank, alpha and modules (or ``path``, a saved PEFT adapter whose own apply), and
    whether it trains (a frozen one, a judge's say, is served and scores its samples but never changes)."""

    name: str
    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    path: str | None
    trainable: bool = True


def module_names(section: Section, name: str) -> str | tuple[str, ...] | None:
    """A module-name key: one string (``all-linear`` or a regex), or a list of names."""
    value = section.raw(name)
    if value is None or isinstance(value, str):
        return value or None
    return section.strings(name)


def check_adapter_path(section: Section, name: str) -> str | None:
    """``section.name``: a PEFT adapter directory (checked here, before anything starts), or None."""
    path = section.optional_str(name)
    if path is not None and not (Path(path) / "adapter_config.json").is_file():
        raise section.error(
            name,
            "is not a PEFT adapter directory (no adapter_config.json there)",
            "name a directory written by PeftModel.save_pretrained, e.g. a checkpoint's actor/lora_adapter",
        )
    return path


def named_adapters(model: Section) -> tuple[AdapterSpec, ...]:
    """The adapters of ``lora_adapters`` in ``model`` (``actor_rollout_ref.model``), in order; () without the list.
    Refuses, naming the key, a list that is not one of mappings, an unknown field, a missing, malformed or repeated
    name, an adapter with neither a rank nor a path, no trainable adapter, or ``lora_adapter_path`` beside it."""
    entries = model.raw(ADAPTERS_KEY)
    if not entries:
        return ()
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise model.error(ADAPTERS_KEY, "is not a list of mappings", "write it as [{name: a}, {name: b}]")
    if model.optional_str("lora_adapter_path") is not None:
        raise model.error(
            "lora_adapter_path",
            f"is set beside {ADAPTERS_KEY}",
            f"give each adapter its own path in {ADAPTERS_KEY} and set lora_adapter_path=null",
        )
    specs = [_spec(model, Section(entry, f"{model.key}.{ADAPTERS_KEY}[{i}]")) for i, entry in enumerate(entries)]
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise model.error(ADAPTERS_KEY, f"names {repeated} more than once", "give each adapter a name of its own")
    if not any(spec.trainable for spec in specs):
        raise model.error(ADAPTERS_KEY, "has no trainable adapter", "set trainable: true on at least one")
    return tuple(specs)


def _spec(model: Section, entry: Section) -> AdapterSpec:
    unknown = sorted(set(entry.node) - _FIELDS)
    if unknown:
        raise entry.error(unknown[0], "is not an adapter field", f"use only {sorted(_FIELDS)}")
    name = entry.str("name")
    if not _NAME.fullmatch(name):
        raise entry.error("name", "is not a plain name", "use letters, digits, '_', '.' and '-' (it names directories)")
    inherited = {key: entry.node.get(key, model.raw(fallback)) for key, fallback in _INHERITED.items()}
    merged = Section(inherited, entry.key)
    path = check_adapter_path(entry, "path")
    rank = merged.int("rank", minimum=0, default=0)
    if rank == 0 and path is None:
        raise entry.error("rank", "is 0 and the adapter has no path", "set its rank (or lora_rank) above 0, or a path")
    return AdapterSpec(
        name=name,
        rank=rank,
        alpha=merged.float("alpha", positive=True, default=16),
        target_modules=module_names(merged, "target_modules") or "all-linear",
        exclude_modules=module_names(merged, "exclude_modules"),
        path=path,
        trainable=entry.bool("trainable", default=True),
    )


_INHERITED = {
    "rank": "lora_rank",
    "alpha": "lora_alpha",
    "target_modules": "target_modules",
    "exclude_modules": "exclude_modules",
}


def adapter_names(model: Section) -> tuple[str, ...]:
    """The names a sample may name (``lora_adapter`` of an agent entry or a row): those of ``lora_adapters``, else
    ``default`` when the policy trains one adapter, else none."""
    specs = named_adapters(model)
    if specs:
        return tuple(spec.name for spec in specs)
    single = model.int("lora_rank", minimum=0, default=0) > 0 or model.optional_str("lora_adapter_path") is not None
    return (DEFAULT_ADAPTER,) if single else ()
