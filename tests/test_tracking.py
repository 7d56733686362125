"""Metrics tracking: the JSONL record a resumed run trims, and a wandb run (offline) that a resume continues."""

from __future__ import annotations

import json

import pytest

from tests.support.config import small_config
from trainer.settings import RunSettings
from trainer.tracking import Tracking


def test_resume_trims_lines_after_the_checkpoint_and_continues_the_wandb_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = small_config("trainer.logger=[wandb]", "trainer.experiment_name=tracking-test")

    first = Tracking(RunSettings.from_config(config), tmp_path)
    for step in (1, 2, 3):  # killed after logging step 3, with its last checkpoint at step 2
        first.log({"critic/score/mean": step / 10}, step)
    first.close()
    resumed = Tracking(RunSettings.from_config(config), tmp_path, resume_step=2)
    resumed.log({"critic/score/mean": 0.35}, 3)
    resumed.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["critic/score/mean"]) for line in lines] == [(1, 0.1), (2, 0.2), (3, 0.35)]
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert first.wandb.id == resumed.wandb.id == run_id
    assert len(list((tmp_path / "wandb").rglob(f"run-{run_id}.wandb"))) == 2  # one offline record per process

    fresh = Tracking(RunSettings.from_config(config), tmp_path)  # resume disabled: a new run, and a new record
    fresh.close()
    assert fresh.wandb.id != run_id and (tmp_path / "metrics.jsonl").read_text() == ""
    assert wandb.run is None


def test_unknown_logger_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown backends \['mlflow'\]; choose from"):
        RunSettings.from_config(small_config("trainer.logger=[console,mlflow]"))


def test_run_settings_refuse_a_bad_resume_mode_naming_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"trainer\.resume_mode='sometimes': is not a known choice; choose one of"):
        RunSettings.from_config(small_config("trainer.resume_mode=sometimes"))
    run = RunSettings.from_config(small_config("trainer.logger=[console]", "trainer.project_name=p"))
    assert (run.logger, run.project_name, run.resume_mode) == (("console",), "p", "auto")
