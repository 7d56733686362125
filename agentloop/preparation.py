"""A config's preparation: the steps under ``task.prepare`` that build what the config reads (data files, a
warm-started model), run as an explicit step of the command before anything starts, never by resolving the config.

A step names a function and the ``path`` the config reads its output from::

    task:
      prepare:
        train_data:
          _target_: agentloop.tasks.arithmetic.data.cached_split
          path: ${agentloop_cache_dir:}/prepared/${trainer.experiment_name}/train.parquet
          split: train
          count: 512
    data:
      train_files: ["${task.prepare.train_data.path}"]

The function is called with the step's other keys; it builds its output into the cache, keyed by everything it is
built from (nothing is built when that output is there already), and returns where it is. ``path`` is then made a
link to it (unless it is that place itself). A new task adds a step by naming its own function.

A step runs only when some key outside ``task.prepare`` names its ``path``: a run that sets its own model
skips the warm start, one that sets its own data skips the data. ``python -m trainer.main_ppo`` prepares before
it starts the trainer; a script that builds an ``AgentLoopManager`` or a ``RayPPOTrainer`` itself calls
``prepare(config)`` first. Both of those check that the data files and local model directories their config names
exist (``check_paths``), naming the key and the fix when one does not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable

from hydra.utils import get_method
from omegaconf import DictConfig, ListConfig, OmegaConf

STEPS_KEY = "task.prepare"
DATA_KEYS = ("data.train_files", "data.val_files")
MODEL_KEYS = ("actor_rollout_ref.model.path", "reward_model.model.path")
FIX_BY_STEP = (
    "task.prepare.{name} builds it: run the command (python -m trainer.main_ppo), or call "
    "agentloop.preparation.prepare(config) before building an AgentLoopManager or RayPPOTrainer yourself"
)
FIX_BY_KEY = (
    "point {key} at an existing {kind}, or add a step under task.prepare whose path it names "
    "(as config/arithmetic_grpo.yaml does for its data and warm start)"
)


def steps(config: DictConfig) -> dict[str, DictConfig]:
    """The preparation steps of ``config`` by name, in order (a step set to null is left out)."""
    node = OmegaConf.select(config, STEPS_KEY)
    if node is None:
        return {}
    found = {}
    for name, step in node.items():
        if step is None:
            continue
        if not isinstance(step, DictConfig) or not isinstance(step.get("_target_"), str) or not step.get("path"):
            raise ValueError(
                f"{STEPS_KEY}.{name}: a preparation step is a mapping with _target_ (the function that builds its "
                "output and returns where it is) and path (where the config reads it), plus the function's arguments"
            )
        found[str(name)] = step
    return found


def prepare(config: DictConfig, only: Iterable[str] | None = None) -> DictConfig:
    """Run the preparation steps whose ``path`` the config reads (or the steps named in ``only``), printing
    what each prepares and whether it was built or found in the cache. Returns ``config`` itself, unchanged:
    ``AgentLoopManager(prepare(compose_config([...])))``, whose start checks the paths (``check_paths``)."""
    resolved = config.copy()
    OmegaConf.resolve(resolved)  # interpolations only: no resolver runs code
    planned = steps(resolved)
    if only is not None:
        only = list(only)
        missing = sorted(set(only) - set(planned))
        if missing:
            raise KeyError(f"prepare(only={only}): no step {missing} under {STEPS_KEY}; it has {sorted(planned)}")
        chosen = {name: step for name, step in planned.items() if name in only}
    else:
        read = _paths_read(resolved)
        chosen = {name: step for name, step in planned.items() if _norm(step.path) in read}
        for name in planned.keys() - chosen.keys():
            print(f"prepare: {name} skipped (no key of the config reads {planned[name].path})", flush=True)
    for index, (name, step) in enumerate(chosen.items(), start=1):
        _run_step(name, step, f"{index}/{len(chosen)}")
    return config


def _run_step(name: str, step: DictConfig, counter: str) -> None:
    """Call the step's function, then point its ``path`` at what it returned."""
    arguments: dict[str, Any] = OmegaConf.to_container(step)
    target, path = arguments.pop("_target_"), Path(os.path.expanduser(str(arguments.pop("path"))))
    shown = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    print(f"prepare [{counter}] {name}: {target}({shown})", flush=True)
    try:
        function = get_method(target)
    except Exception as error:
        raise ValueError(f"{STEPS_KEY}.{name}._target_={target!r} is not an importable function: {error}") from error
    linked_before = path.resolve() if path.exists() else None
    started = time.time()
    built = Path(os.path.abspath(os.path.expanduser(str(function(**arguments)))))
    if not built.exists():
        raise FileNotFoundError(f"{STEPS_KEY}.{name}: {target} returned {str(built)!r}, which does not exist")
    # what the path showed already, or written before this call: found in the cache (a file's time may lag the
    # clock by a tick of the kernel's coarse clock)
    fresh = built.resolve() != linked_before and built.stat().st_mtime >= started - 0.05
    state = "built" if fresh else "cached"
    _link(path, built, name)
    print(f"prepare [{counter}] {name}: {state} in {time.time() - started:.1f}s: {path} -> {built}", flush=True)


def _link(path: Path, built: Path, name: str) -> None:
    """Make ``path`` a link to ``built``, atomically (a reader never sees it missing); nothing when it is one."""
    if path.exists() and path.resolve() == built.resolve():
        return
    if path.exists() and not path.is_symlink():
        raise FileExistsError(
            f"{STEPS_KEY}.{name}.path={str(path)!r} holds a file or directory the preparation did not link there; "
            "remove it or choose another path"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.link")
    staging.unlink(missing_ok=True)
    os.symlink(built, staging)
    os.replace(staging, path)


def _norm(path: Any) -> str:
    return os.path.normpath(os.path.expanduser(str(path)))


def _paths_read(config: DictConfig) -> set[str]:
    """Every string value outside ``task.prepare``, as a path (what a step's output may be read as)."""
    tree = OmegaConf.to_container(config)
    tree.get("task", {}).pop("prepare", None)
    values: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
        elif isinstance(node, str):
            values.add(_norm(node))

    visit(tree)
    return values


def _named(config: DictConfig, keys: Iterable[str]) -> list[tuple[str, str]]:
    """``(key, path)`` for each path the keys name (a list's entries as ``key[i]``)."""
    named = []
    for key in keys:
        value = OmegaConf.select(config, key)
        if isinstance(value, (list, ListConfig)):
            named += [(f"{key}[{index}]", str(item)) for index, item in enumerate(value)]
        elif value is not None:
            named.append((key, str(value)))
    return named


def _local(path: str) -> bool:
    # a model may be named by its hub id (org/name); one that starts like a path is a directory here
    return os.path.isabs(path) or path.startswith((".", "~"))


def check_paths(config: DictConfig, data: bool = True) -> None:
    """Fail when a data file (with ``data``) or a local model directory the resolved ``config`` names is missing,
    naming the key and the fix: the preparation step that builds it, or an existing path."""
    by_step = {_norm(step.path): name for name, step in steps(config).items()}
    wanted = [(key, path, "data file") for key, path in _named(config, DATA_KEYS if data else ())]
    wanted += [(key, path, "model") for key, path in _named(config, MODEL_KEYS) if _local(path)]
    for key, path, kind in wanted:
        if "://" in path or os.path.exists(os.path.expanduser(path)):
            continue
        name = by_step.get(_norm(path))
        fix = FIX_BY_STEP.format(name=name) if name else FIX_BY_KEY.format(key=key.split("[")[0], kind=kind)
        raise FileNotFoundError(f"{kind} {path!r} does not exist ({key}): {fix}")
