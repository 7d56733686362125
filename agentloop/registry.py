"""Agent-loop registry: ``@register("name")`` on a class, or a YAML file of ``{name, _target_, ...}``.

An entry's ``lora_adapter`` (not a constructor argument) names the LoRA adapter its samples use
(``actor_rollout_ref.model.lora_adapters``); a row's own ``lora_adapter`` column overrides it (``sample_adapter``).

The driver resolves the registry once into plain specs and ships them to the workers, so loops defined
in a user's script (not importable by the workers) still work: their class travels by value.
Loops are built per sample with ``hydra.utils.instantiate``.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Callable

import yaml
from hydra.utils import get_class, instantiate

from agentloop.agent_loop.base import _REGISTRY, register  # noqa: F401  (register: agentloop.registry.register)

# The built-in loops are named by dotted path, as a YAML entry names a user's loop.
BUILTIN_AGENT_LOOPS: dict[str, dict[str, Any]] = {
    "single_turn_agent": {"_target_": "agentloop.agent_loop.single_turn.SingleTurnAgentLoop"},
    "tool_agent": {"_target_": "agentloop.agent_loop.tool_agent.ToolAgentLoop"},
    "env_agent": {"_target_": "agentloop.agent_loop.env_agent.EnvAgentLoop"},
    "external_agent": {"_target_": "agentloop.agent_loop.external_agent.ExternalAgentLoop"},
    "verifiers_agent": {"_target_": "agentloop.agent_loop.verifiers_agent.VerifiersAgentLoop"},
}


def load_agent_loop_file(path: str) -> dict[str, dict[str, Any]]:
    """Read a YAML list of ``{name, _target_, ...kwargs}``; every error names the file and the field."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"agent loop config {path!r} does not exist (actor_rollout_ref.rollout.agent.agent_loop_config_path)"
        )
    entries = yaml.safe_load(file.read_text()) or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a YAML list of {{name, _target_}} entries, got {type(entries).__name__}")
    specs: dict[str, dict[str, Any]] = {}
    for position, entry in enumerate(entries):
        where = f"{path}: entry {position}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with 'name' and '_target_', got {entry!r}")
        for key in ("name", "_target_"):
            if not entry.get(key):
                raise ValueError(f"{where}: missing field {key!r}")
        try:
            get_class(entry["_target_"])
        except Exception as error:
            raise ValueError(
                f"{where}: field '_target_' = {entry['_target_']!r} cannot be imported: {error}"
            ) from error
        spec = dict(entry)
        specs[spec.pop("name")] = spec
    return specs


def resolve_agent_loops(agent_loop_config_path: str | None = None) -> dict[str, dict[str, Any]]:
    """All registered loops: the built-ins, then decorator registrations, then the YAML file's entries."""
    specs = {**BUILTIN_AGENT_LOOPS, **_REGISTRY}
    if agent_loop_config_path:
        specs.update(load_agent_loop_file(agent_loop_config_path))
    return specs


ADAPTER_FIELD = "lora_adapter"


def sample_adapter(row: dict[str, Any], spec: dict[str, Any]) -> str | None:
    """The LoRA adapter a row's sample is generated with and trains: the row's ``lora_adapter``, else its agent
    entry's; None: the policy's first (or only) adapter."""
    return row.get(ADAPTER_FIELD) or spec.get(ADAPTER_FIELD)


def check_adapter_names(
    rows: list[dict[str, Any]], specs: dict[str, dict[str, Any]], adapters: tuple[str, ...]
) -> list[str]:
    """Problems: agent entries and rows naming a LoRA adapter the policy lacks (``adapters``: its names)."""
    problems = [
        f"agent loop {name!r} has lora_adapter={spec[ADAPTER_FIELD]!r}, which is not among the policy's adapters "
        f"{list(adapters)} (actor_rollout_ref.model.lora_adapters)"
        for name, spec in specs.items()
        if spec.get(ADAPTER_FIELD) and spec[ADAPTER_FIELD] not in adapters
    ]
    unknown = sorted({str(row[ADAPTER_FIELD]) for row in rows if row.get(ADAPTER_FIELD)} - set(adapters))
    if unknown:
        problems.append(
            f"rows have lora_adapter {unknown}, not among the policy's adapters {list(adapters)} "
            "(actor_rollout_ref.model.lora_adapters)"
        )
    return problems


def check_agent_names(names: set[str], specs: dict[str, dict[str, Any]]) -> None:
    """Fail before any generation if a row names a loop that is not registered."""
    unknown = sorted(names - set(specs))
    if unknown:
        raise KeyError(
            f"unknown agent_name {unknown}; registered agent loops: {sorted(specs)}. Register one with "
            "@agentloop.register(name) or list it in actor_rollout_ref.rollout.agent.agent_loop_config_path"
        )


def build_agent_loop(
    spec: dict[str, Any], offered: dict[str, Callable[[], Any]] | None = None, **dependencies: Any
) -> Any:
    """Instantiate one agent loop from its spec, handing it the worker's router, tokenizer and config, and each of
    ``offered`` (name -> what makes it: the worker's gateway) that its constructor names as a parameter."""
    if ADAPTER_FIELD in spec:  # the router's business, not the loop's
        spec = {key: value for key, value in spec.items() if key != ADAPTER_FIELD}
    target = spec["_target_"]
    for name, make in (offered or {}).items():
        if name in _parameters(target):
            dependencies[name] = make()
    if not isinstance(target, str):
        # A decorated class travels by value; hydra would re-import it by name, which a worker may not manage.
        return target(**dependencies)
    if all(isinstance(value, (str, int, float, bool, type(None))) for value in spec.values()):
        return _scalar_spec_factory(tuple(sorted(spec.items())))(**dependencies)
    # _partial_ because hydra's own first parameter is named `config`, like the dependency we pass.
    return instantiate(spec, _partial_=True)(**dependencies)


@functools.lru_cache(maxsize=64)
def _parameters(target: type | str) -> frozenset[str]:
    """The names a loop class's constructor takes (looked up once per class: loops are built per sample)."""
    return frozenset(inspect.signature(get_class(target) if isinstance(target, str) else target).parameters)


@functools.lru_cache(maxsize=64)
def _scalar_spec_factory(spec: tuple[tuple[str, Any], ...]) -> Any:
    # hydra's partial of a spec whose arguments are all scalars (nothing a loop could mutate or should get its own
    # copy of), made once per process: instantiating costs milliseconds, per sample in a worker's hottest path
    return instantiate(dict(spec), _partial_=True)
