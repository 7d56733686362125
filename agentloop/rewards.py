"""Reward functions chosen by a row's ``data_source`` (``custom_reward_function`` in config).

A reward function is ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``; a dict
carries its score under ``"score"`` and any other keys as per-sample extras. ``by_data_source`` and
``default`` name functions by dotted path; verl's ``path`` + ``name`` name one in a Python file instead,
standing for ``default``.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable

from hydra.utils import get_method
from omegaconf import DictConfig


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Callable[..., Any]:
    try:
        return get_method(path)
    except Exception as error:
        raise ValueError(f"custom_reward_function: {path!r} cannot be imported: {error}") from error


@functools.lru_cache(maxsize=None)
def _load_from_file(file: str, name: str) -> Callable[..., Any]:
    path = Path(file).expanduser()
    if not path.is_file():
        raise ValueError(f"custom_reward_function.path: {file!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"agentloop_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"custom_reward_function: {file} defines no function {name!r} (custom_reward_function.name)")
    return getattr(module, name)


def reward_function_for(config: DictConfig, data_source: str | None) -> Callable[..., Any] | None:
    """The function named for this data source, else the default one (``default``, or ``path`` + ``name``),
    else None."""
    section = config.get("custom_reward_function") or {}
    path = (section.get("by_data_source") or {}).get(data_source) or section.get("default")
    if path:
        return _load(path)
    if section.get("path"):
        return _load_from_file(str(section.path), str(section.get("name") or "compute_score"))
    return None


def score(function: Callable[..., Any], data_source: str | None, solution: str, ground_truth: Any, extra_info: Any):
    """Call a reward function; return ``(score, extras)``."""
    result = function(data_source, solution, ground_truth, extra_info)
    if isinstance(result, dict):
        extras = {key: value for key, value in result.items() if key != "score"}
        return float(result["score"]), extras
    return float(result), {}


def reward_for_row(config: DictConfig, row: dict[str, Any], final_text: str) -> tuple[float, dict[str, Any]] | None:
    """Score the final answer with the function configured for the row's data source, if any."""
    function = reward_function_for(config, row.get("data_source"))
    if function is None:
        return None
    ground_truth = (row.get("reward_model") or {}).get("ground_truth")
    return score(function, row.get("data_source"), final_text, ground_truth, row.get("extra_info"))
