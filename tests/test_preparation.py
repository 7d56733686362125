"""A config is declarative (``agentloop.preparation``): composing and resolving one builds nothing; what it reads that
has to be built is listed under ``task.prepare`` and built by an explicit step (the command's), shown as it goes, and
cached; a path nothing builds fails with its key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from agentloop.config import CONFIG_DIR, compose_config
from agentloop.preparation import check_paths, prepare
from trainer.data import read_rows
from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.tasks.arithmetic.data import make_rows

SHIPPED = sorted(path.stem for path in CONFIG_DIR.glob("*.yaml") if path.stem != "verl_ignored")


def files_under(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*"))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("AGENTLOOP_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("name", SHIPPED)
def test_resolving_a_shipped_config_builds_nothing(name, empty_cache):
    config = compose_config(config_name=name)
    OmegaConf.resolve(config)
    assert files_under(empty_cache) == []
    # what it reads is named by plain paths in the cache, each the output of one of its steps
    outputs = {step.path for step in config.task.prepare.values() if step is not None}  # (null: a step left out)
    assert config.actor_rollout_ref.model.path in outputs
    assert config.actor_rollout_ref.model.path.startswith(str(empty_cache))
    assert set(config.data.train_files or []) <= outputs and set(config.data.val_files or []) <= outputs


def test_the_old_resolvers_that_ran_code_fail_with_the_new_way(empty_cache):
    config = OmegaConf.create({"path": "${agentloop_call:agentloop.tasks.corridor.warm_start.warm_start_path}"})
    with pytest.raises(InterpolationResolutionError, match=r"runs no code any more.*task\.prepare"):
        OmegaConf.resolve(config)
    with pytest.raises(InterpolationResolutionError, match="default actor_rollout_ref.model.path is the tiny model"):
        OmegaConf.resolve(OmegaConf.create({"path": "${agentloop_tiny_model:}"}))
    assert files_under(empty_cache) == []


def test_preparation_builds_what_the_config_reads_shows_it_and_then_finds_it_cached(empty_cache, model_path, capsys):
    # the warm start is not read (the run sets its own model) and not trained: only the data is built
    config = compose_config([f"actor_rollout_ref.model.path={model_path}"], config_name="arithmetic_grpo")
    assert prepare(config) is config
    shown = capsys.readouterr().out
    assert "prepare: warm_start skipped (no key of the config reads" in shown
    assert "prepare: tiny_model skipped" in shown
    assert "prepare [1/2] train_data: agentloop.tasks.arithmetic.data.cached_split(split='train'" in shown
    assert "prepare [1/2] train_data: built in" in shown and "prepare [2/2] val_data: built in" in shown
    train = Path(config.data.train_files[0])
    assert train.is_symlink() and train.resolve() == empty_cache / "data" / "arithmetic-512-9-0" / "train.parquet"
    assert read_rows(str(train)) == make_rows(512, split="train", max_operand=9)
    assert not (empty_cache / "models").exists()

    prepare(config)
    shown = capsys.readouterr().out
    assert "prepare [1/2] train_data: cached in" in shown and "prepare [2/2] val_data: cached in" in shown


def test_a_step_whose_inputs_change_points_its_path_at_the_new_build(empty_cache, model_path):
    """A new task's step is a function named in the config; its path follows what it was built from."""
    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        "+task.prepare.rows._target_=agentloop.tasks.arithmetic.data.cached_split",
        f"+task.prepare.rows.path={empty_cache / 'mine' / 'rows.parquet'}",
        "+task.prepare.rows.split=train",
        "data.train_files=[${task.prepare.rows.path}]",
    ]
    for count in (3, 5):
        config = prepare(compose_config([*overrides, f"+task.prepare.rows.count={count}"]))
        assert len(read_rows(config.data.train_files[0])) == count
    assert sorted(path.name for path in (empty_cache / "data").iterdir()) == ["arithmetic-3-99-0", "arithmetic-5-99-0"]


def test_the_default_tiny_model_is_built_by_preparation_only(empty_cache):
    config = compose_config()
    OmegaConf.resolve(config)
    with pytest.raises(FileNotFoundError, match=r"\(actor_rollout_ref.model.path\): task.prepare.tiny_model builds it"):
        check_paths(config)
    prepare(config)
    # the config names the builder's own directory (ppo_trainer.yaml keeps tiny_qwen.MODEL_NAME)
    assert config.actor_rollout_ref.model.path == tiny_model_path()
    assert (Path(config.actor_rollout_ref.model.path) / "config.json").exists()


def test_a_missing_path_fails_naming_its_key_and_the_fix(empty_cache, model_path):
    config = compose_config(
        ["data.train_files=[/nonexistent/train.parquet]", f"actor_rollout_ref.model.path={model_path}"]
    )
    prepare(config)  # nothing to build
    OmegaConf.resolve(config)
    with pytest.raises(
        FileNotFoundError,
        match=r"data file '/nonexistent/train.parquet' does not exist \(data.train_files\[0\]\): point data.train_files "
        r"at an existing data file, or add a step under task.prepare",
    ):
        check_paths(config)
    # a path a step builds, not prepared: the trainer and the manager say which step and how to run it
    config = compose_config(config_name="corridor_grpo")
    OmegaConf.resolve(config)
    with pytest.raises(FileNotFoundError, match=r"\(data.train_files\[0\]\): task.prepare.train_data builds it"):
        check_paths(config)
    with pytest.raises(FileNotFoundError, match=r"task.prepare.warm_start builds it: run the command"):
        check_paths(config, data=False)
    assert files_under(empty_cache) == []


def test_building_a_manager_builds_nothing(empty_cache):
    from agentloop import AgentLoopManager

    with pytest.raises(FileNotFoundError, match=r"agentloop.preparation.prepare\(config\) before building"):
        AgentLoopManager(compose_config())
    assert files_under(empty_cache) == []
