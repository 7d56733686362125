"""Rollout dumps and the trajectory viewer over a real short training run of the scripted tool model:
the dump's exact tokens and turns, the viewer's JSON API over HTTP, bad input, live steps, and the
page itself in headless Chromium (Debian's ``chromium`` and ``chromium-driver``); and over a batch padded by hand
whose first trajectory's context was rewritten (two segments) and whose tokens come from three policy versions."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests
import torch
from transformers import AutoTokenizer

from agentloop.batch import RolloutBatch, object_array
from agentloop.dumps import FORMAT, read_rollout_dump, write_rollout_dump
from agentloop.policy_versions import VersionRuns
from agentloop.postprocess import pad_outputs
from agentloop.protocol import (
    BATCH_FIELDS,
    SCORE_FIELDS,
    AgentLoopOutput,
    SampleScore,
    Segment,
    ToolCallRecord,
    TurnRecord,
)
from agentloop.rows import write_rows
from agentloop.viewer.store import RunStore
from tests.support.config import small_config
from tests.support.models import script_row
from trainer.main_ppo import run

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("multi", "badargs", "parallel", "unknown")


@pytest.fixture(scope="module")
def run_dir(local_ray, scripted_model, tmp_path_factory) -> Path:
    """Two GRPO steps of the scripted tool model (4 rows x 2 samples a step), dumps in ``<run>/rollouts``."""
    tmp = tmp_path_factory.mktemp("viewer_run")
    rows = [script_row(name, data_source=f"script_{name}") for name in SCRIPTS] * 2
    train = write_rows(
        [{**row, "extra_info": {**row["extra_info"], "index": i}} for i, row in enumerate(rows)],
        str(tmp / "train.jsonl"),
    )
    out = tmp / "run"
    run(
        small_config(
            f"actor_rollout_ref.model.path={scripted_model.path}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={scripted_model.tools_path}",
            f"data.train_files=[{train}]",
            "data.train_batch_size=4",
            "data.max_prompt_length=768",
            "data.max_response_length=256",
            "data.shuffle=false",
            "actor_rollout_ref.rollout.n=2",
            # sampled, but far from the scripted turns' margins: the turns (and their tool calls) are the scripts'
            "actor_rollout_ref.rollout.temperature=0.3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "trainer.total_training_steps=2",
            "trainer.logger=[console]",
            f"trainer.rollout_data_dir={out / 'rollouts'}",
            f"trainer.default_local_dir={out}",
        )
    )
    return out


def test_dump_holds_exact_tokens_turns_and_tool_calls(run_dir):
    format_name, records = read_rollout_dump(run_dir / "rollouts" / "step_000001.parquet")
    assert format_name == FORMAT and len(records) == 8
    assert {record["data_source"] for record in records} == {f"script_{name}" for name in SCRIPTS}
    assert len({record["uid"] for record in records}) == 4  # GRPO groups of 2
    for record in records:
        n = record["response_length"]
        for key in ("response_ids", "response_mask", "token_text", "rollout_log_probs", "old_log_probs", "advantages"):
            assert len(record[key]) == n, key
        assert "".join(record["token_text"]) == record["output"]
        # one segment, the top-level columns; every token's policy version: step 1 sampled with version 0
        assert len(record["segments"]) == 1 and record["segments"][0]["rewritten_by"] is None
        assert record["segments"][0]["response_ids"] == record["response_ids"]
        versions = VersionRuns(record["policy_version_runs"]).per_token()
        assert versions == [record["policy_version"] if mask else -1 for mask in record["response_mask"]]
        # the turns tile the response; model turns are exactly the mask-1 tokens
        turns = record["turns"]
        assert turns[0]["start"] == 0 and turns[-1]["end"] == n
        assert all(a["end"] == b["start"] for a, b in zip(turns, turns[1:]))
        for turn in turns:
            expected = 1 if turn["role"] == "assistant" else 0
            assert set(record["response_mask"][turn["start"] : turn["end"]]) == {expected}
        # same weights at step 1: the trainer scores the sampled tokens as the engine did
        gaps = [
            abs(a - b)
            for a, b, m in zip(record["rollout_log_probs"], record["old_log_probs"], record["response_mask"])
            if m
        ]
        assert max(gaps) < 1e-3
        assert (
            record["score"] == record["reward_parts"]["reward_score"] or record["reward_parts"]["reward_score"] is None
        )
    calls = {record["data_source"]: [c for t in record["turns"] for c in t["tool_calls"]] for record in records}
    assert [c["name"] for c in calls["script_multi"]] == ["calculator", "submit_answer"]
    assert (
        calls["script_multi"][0]["arguments"] == {"expression": "2 + 3"} and calls["script_multi"][0]["result"] == "5"
    )
    assert calls["script_badargs"][0]["error"] == "invalid_arguments"
    assert calls["script_unknown"][0]["error"] == "unknown_tool"
    assert {turn["role"] for record in records for turn in record["turns"]} == {"assistant", "tool"}


def test_rollout_metrics_reach_the_metrics_log(run_dir):
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in history] == [1, 2]
    for line in history:
        assert line["num_turns/mean"] > 2 and line["tool_call_counts/max"] >= 2
        assert 0 < line["multi_turn/tool_error_rate"] < 1
        assert (
            line["multi_turn/tool_errors/invalid_arguments"] == 2 and line["multi_turn/tool_errors/unknown_tool"] == 2
        )
        assert line["rollout/requests_per_server/0"] >= 8 and 0 <= line["rollout/cached_token_share"] <= 1
        spread = [line[f"timing_s/agent_loop/generate_sequences/{key}"] for key in ("min", "mean", "max")]
        assert spread == sorted(spread)
        assert sum(value for key, value in line.items() if key.startswith("multi_turn/finish_reason/")) == 8
    assert history[1]["timing_s/rollout_dump"] > 0  # step 1's dump, written while step 2 ran


# ---------------------------------------------------------------------- the viewer's server


@contextlib.contextmanager
def viewer(path: Path, *args: str) -> Iterator[str]:
    """``python -m agentloop.viewer PATH --port 0`` as a user starts it; yields its base URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "agentloop.viewer", str(path), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        while not (match := re.search(r"http://127\.0\.0\.1:\d+/", "".join(lines))):
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines) + process.stdout.read()
            lines.append(process.stdout.readline())
        yield match.group(0)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_api_serves_steps_samples_groups_and_exports(run_dir, tmp_path):
    with viewer(run_dir) as url:
        summary = requests.get(url + "api/run", timeout=30).json()
        assert summary["steps"] == [1, 2] and summary["problems"] == []
        assert [line["step"] for line in summary["metrics"]] == [1, 2]
        table = requests.get(url + "api/steps/2", timeout=30).json()
        assert [row["sample"] for row in table["samples"]] == list(range(8))
        multi = next(row for row in table["samples"] if row["data_source"] == "script_multi")
        assert multi["tool_calls"] == 2 and multi["tool_errors"] == 0 and multi["finish_reason"] == "stop"
        sample = requests.get(url + f"api/steps/2/samples/{multi['sample']}", timeout=30).json()
        assert sample["prompt_messages"] == [{"role": "user", "content": "script multi"}]
        assert len(sample["tokens"]["text"]) == len(sample["tokens"]["mask"]) == multi["response_length"]
        group = requests.get(url + f"api/steps/2/groups/{multi['uid']}", timeout=30).json()
        assert [member["data_source"] for member in group["samples"]] == ["script_multi"] * 2
        missing = requests.get(url + "api/steps/9", timeout=30)
        assert missing.status_code == 404 and "steps with dumps: [1, 2]" in missing.json()["detail"]
        exported = requests.get(url + "export/2", timeout=30)
        assert exported.status_code == 200 and 'id="agentloop-data"' in exported.text

    result = subprocess.run(
        [sys.executable, "-m", "agentloop.viewer", str(run_dir), "--export", "1", "-o", str(tmp_path / "step1.html")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "step1.html").read_text()
    assert '<script src="static/' not in page and "<!--AGENTLOOP_DATA-->" not in page


def test_bad_input_is_reported_never_a_crash(run_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    summary = RunStore(empty).run()
    assert summary["steps"] == [] and "no rollout dumps found" in summary["found"]
    assert any("no metrics.jsonl" in problem for problem in summary["problems"])

    broken = tmp_path / "broken"
    (broken / "rollouts").mkdir(parents=True)
    good = (run_dir / "rollouts" / "step_000001.parquet").read_bytes()
    (broken / "rollouts" / "step_000001.parquet").write_bytes(good)
    (broken / "rollouts" / "step_000002.parquet").write_bytes(good[: len(good) // 2])  # a running job's half file
    table = pa.Table.from_pylist([{"step": 3}]).replace_schema_metadata({"format": "agentloop-rollouts/0"})
    pq.write_table(table, broken / "rollouts" / "step_000003.parquet")  # an older format
    (broken / "rollouts" / "4.jsonl").write_text(
        json.dumps({"input": "q", "output": "a", "score": 1.0, "step": 4}) + "\n"
    )
    (broken / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n{"step": 2, "critic/sc')

    with viewer(broken) as url:
        summary = requests.get(url + "api/run", timeout=30).json()
        assert summary["steps"] == [1, 4]
        problems = "\n".join(summary["problems"])
        assert (
            "step 2: step_000002.parquet: could not read it as Parquet" in problems
            and "still being written?" in problems
        )
        assert "step 3: step_000003.parquet: written as 'agentloop-rollouts/0'" in problems
        assert "metrics.jsonl line 2: not JSON; still being written?" in problems
        assert summary["metrics"] == [{"step": 1, "critic/score/mean": 0.5}]
        half = requests.get(url + "api/steps/2", timeout=30)
        assert half.status_code == 422 and "still being written?" in half.json()["detail"]
        legacy = requests.get(url + "api/steps/4", timeout=30).json()
        assert legacy["format"] == "verl-jsonl (text only)" and legacy["samples"][0]["reward"] == 1.0
        assert requests.get(url + "api/steps/4/samples/0", timeout=30).json()["segments"][0]["turns"][0]["text"] == "a"


# ---------------------------------------------------------------------- the page in a real browser


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser():
    found = _chromium()
    if found is None:
        pytest.skip("headless Chromium is not installed: apt-get install chromium chromium-driver (.ci/run tries to)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,1100",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser):
    """The browser with an empty console, left on a blank page (a page left open would go on polling a stopped server)."""
    browser.get_log("browser")
    yield browser
    browser.get("about:blank")
    browser.get_log("browser")


def wait_until(condition, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(0.1)


def console_problems(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def test_page_shows_steps_samples_turns_and_groups(run_dir, page, tmp_path):
    browser = page
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    live = tmp_path / "live"
    (live / "rollouts").mkdir(parents=True)
    shutil.copy(run_dir / "metrics.jsonl", live / "metrics.jsonl")
    shutil.copy(run_dir / "rollouts" / "step_000001.parquet", live / "rollouts")
    records = read_rollout_dump(run_dir / "rollouts" / "step_000001.parquet")[1]
    with viewer(live) as url:
        browser.get(url + "#/step/1")
        rows = wait_until(
            lambda: browser.find_elements(By.CSS_SELECTOR, "#sample-table tr.sample-row"), "the sample table"
        )
        assert sorted(int(row.get_attribute("data-sample")) for row in rows) == list(range(len(records)))
        assert browser.find_elements(By.CSS_SELECTOR, "#curves svg"), "no curves drawn"

        # a sample with a tool call: its turns, model and observation tokens told apart
        multi = next(i for i, record in enumerate(records) if record["data_source"] == "script_multi")
        browser.find_element(By.CSS_SELECTOR, f'#sample-table tr.sample-row[data-sample="{multi}"]').click()
        view = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#sample-view .turn"), "the sample's turns")
        assert [turn.get_attribute("data-role") for turn in view] == [turn["role"] for turn in records[multi]["turns"]]
        model = browser.find_elements(By.CSS_SELECTOR, '#sample-view .turn[data-role="assistant"] .tok')
        observed = browser.find_elements(By.CSS_SELECTOR, '#sample-view .turn[data-role="tool"] .tok')
        assert len(model) == sum(records[multi]["response_mask"]) and all(
            "tok-model" in t.get_attribute("class") for t in model
        )
        assert len(observed) == records[multi]["response_length"] - len(model)
        assert all("tok-obs" in t.get_attribute("class") for t in observed)
        colours = {
            browser.execute_script("return getComputedStyle(arguments[0]).backgroundColor", t)
            for t in (model[0], observed[0])
        }
        assert len(colours) == 2, "model and observation tokens look the same"
        assert len(browser.find_elements(By.CSS_SELECTOR, "#sample-view details.tool-call")) == 2
        Select(browser.find_element(By.ID, "colour-mode")).select_by_value("gap")
        browser.save_screenshot(str(tmp_path / "sample.png"))
        assert (tmp_path / "sample.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # the GRPO group side by side
        browser.get(url + f"#/step/1/group/{records[multi]['uid']}")
        members = wait_until(
            lambda: browser.find_elements(By.CSS_SELECTOR, "#group-view .group-sample"), "the group view"
        )
        assert len(members) == 2 and all(m.find_element(By.CSS_SELECTOR, ".reward").text for m in members)

        # live: a step the job writes now shows up without a reload
        shutil.copy(run_dir / "rollouts" / "step_000002.parquet", live / "rollouts")
        # read in one script: polling rebuilds the options, so element handles can go stale between calls
        options = "return [...document.querySelectorAll('#step-select option')].map(o => o.value).sort()"
        wait_until(lambda: browser.execute_script(options) == ["1", "2"], "step 2 in the step selector", 20)
        assert console_problems(browser) == []


def test_exported_step_opens_from_a_file(run_dir, page, tmp_path):
    browser = page
    from selenium.webdriver.common.by import By

    exported = tmp_path / "step2.html"
    subprocess.run(
        [sys.executable, "-m", "agentloop.viewer", str(run_dir), "--export", "2", "-o", str(exported)],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=REPO,
    )
    browser.get(exported.as_uri() + "#/step/2/sample/0")
    wait_until(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, "#sample-table tr.sample-row")) == 8, "the exported table"
    )
    wait_until(
        lambda: browser.find_elements(By.CSS_SELECTOR, "#sample-view .turn .tok"), "the exported sample's tokens"
    )
    assert console_problems(browser) == []
    if os.environ.get("AGENTLOOP_VIEWER_SCREENSHOT"):  # how the picture in the README and docs/img/viewer.png is made
        browser.save_screenshot(os.environ["AGENTLOOP_VIEWER_SCREENSHOT"])


# ---------------------------------------------------------------------- segments and policy versions


def response(tokenizer, *parts: tuple[str, int]) -> dict[str, list]:
    """A segment's response from (text, policy version) parts; version -1: an observation."""
    ids, mask, versions = [], [], []
    for text, version in parts:
        part = tokenizer.encode(text, add_special_tokens=False)
        ids, mask, versions = ids + part, mask + [int(version >= 0)] * len(part), versions + [version] * len(part)
    return {
        "response_ids": ids,
        "response_mask": mask,
        "response_logprobs": [-0.5 * m for m in mask],
        "policy_versions": versions,
    }


def pad_like_the_worker(rows: list[dict], outputs: list[AgentLoopOutput], pad_token_id: int) -> RolloutBatch:
    """What ``AgentLoopWorker._pad`` (a Ray actor's method) makes of finished trajectories: one row per segment,
    each trajectory's columns repeated on its rows; with the ``policy_version`` stamp the trainer adds."""
    repeats = [len(output.all_segments()) for output in outputs]

    def column(values: list) -> object:
        return object_array([value for value, count in zip(values, repeats) for _ in range(count)])

    non_tensor = {key: column([row.get(key) for row in rows]) for key in rows[0]}
    non_tensor.update({name: column([getattr(output, name) for output in outputs]) for name in BATCH_FIELDS})
    non_tensor.update({name: column([getattr(SampleScore(), name)] * len(outputs)) for name in SCORE_FIELDS})
    non_tensor["generate_time_s"] = column([1.5] * len(outputs))
    non_tensor["policy_version"] = column([3] * len(outputs))
    non_tensor["rewritten_by"] = object_array(
        [segment.rewritten_by for output in outputs for segment in output.all_segments()]
    )
    return RolloutBatch(pad_outputs(outputs, 64, 64, pad_token_id), non_tensor, {"pad_token_id": pad_token_id})


@pytest.fixture(scope="module")
def segments_run(model_path, tmp_path_factory) -> tuple[Path, list[AgentLoopOutput], AutoTokenizer]:
    """A run directory with one step: a GRPO group of two trajectories, the first's context rewritten by a
    ``summarize`` strategy after a tool call (tokens of versions 3, 4, 5), the second one segment (version 5)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    question = "Question: what is 2 + 3?"
    first = Segment(
        tokenizer.encode(question),
        **response(tokenizer, ("calculator(2 + 3)", 3), ("result: 5", -1), (" So it is", 4)),
    )
    rewritten = AgentLoopOutput(
        prompt_ids=tokenizer.encode("Summary: the calculator said 2 + 3 = 5."),
        **response(tokenizer, ("The answer", 4), (" is 5.", 5)),
        rewritten_by="summarize",
        segments=[first],
        num_turns=5,
        reward_score=1.0,
        end_reason="stop",
        observation_roles=["tool"],
        turns=[
            TurnRecord(4, 5, calls=[ToolCallRecord("calculator", {"expression": "2 + 3"}, "5")], step_reward=0.25),
            TurnRecord(3),
            TurnRecord(4, interaction_score=-0.5),
        ],
    )
    single = AgentLoopOutput(
        prompt_ids=tokenizer.encode(question),
        **response(tokenizer, ("It is 4.", 5)),
        num_turns=2,
        reward_score=0.0,
        end_reason="stop",
        turns=[TurnRecord(4)],
    )
    outputs = [rewritten, single]
    rows = [
        {
            "uid": "g0",
            "index": 7,
            "data_source": "hand",
            "agent_name": "tool_agent",
            "request_id": f"r{i}",
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"ground_truth": "5"},
        }
        for i in range(len(outputs))
    ]
    batch = pad_like_the_worker(rows, outputs, tokenizer.pad_token_id)
    assert len(batch) == 3 and batch.batch["segment_index"].tolist() == [0, 1, 0]
    advantages = (
        batch.batch["response_mask"].float() * torch.tensor([1.0, 1.0, -1.0])[:, None]
    )  # GRPO: one per trajectory
    run_dir = tmp_path_factory.mktemp("segments_run")
    write_rollout_dump(run_dir / "rollouts", 1, batch, tokenizer, advantages=advantages)
    return run_dir, outputs, tokenizer


def test_dump_has_one_record_per_trajectory_with_its_segments_and_policy_versions(segments_run):
    run_dir, outputs, tokenizer = segments_run
    path = run_dir / "rollouts" / "step_000001.parquet"
    format_name, records = read_rollout_dump(path)
    assert format_name == FORMAT and [record["sample"] for record in records] == [0, 1]
    for record, output in zip(records, outputs):
        segments = output.all_segments()
        assert [dumped["rewritten_by"] for dumped in record["segments"]] == [
            segment.rewritten_by for segment in segments
        ]
        for dumped, segment in zip(record["segments"], segments):
            assert dumped["prompt_ids"] == segment.prompt_ids and dumped["input"] == tokenizer.decode(
                segment.prompt_ids
            )
            assert dumped["response_ids"] == segment.response_ids and dumped["response_mask"] == segment.response_mask
            assert "".join(dumped["token_text"]) == dumped["output"] == tokenizer.decode(segment.response_ids)
            assert VersionRuns(dumped["policy_version_runs"]).per_token() == segment.policy_versions
            assert len(dumped["advantages"]) == len(dumped["rollout_log_probs"]) == len(segment.response_ids)
            turns = dumped["turns"]
            assert turns[0]["start"] == 0 and turns[-1]["end"] == len(segment.response_ids)
        # the top-level columns are the last segment's: what a reader of one-segment dumps reads
        assert record["prompt_ids"] == output.prompt_ids and record["response_ids"] == output.response_ids
        assert record["rewritten_by"] == output.rewritten_by
        assert record["response_length"] == sum(len(segment.response_ids) for segment in segments)
        assert record["model_tokens"] == sum(sum(segment.response_mask) for segment in segments)
        assert (
            record["score"] == output.reward_score
            and record["finish_reason"] == "stop"
            and record["policy_version"] == 3
        )

    rewritten = records[0]
    assert [len(segment["policy_version_runs"]) for segment in rewritten["segments"]] == [
        3,
        2,
    ]  # compact: one run per turn
    assert [version for version, _ in rewritten["segments"][0]["policy_version_runs"]] == [3, -1, 4]
    # the loop's turns and observation roles run on from one segment to the next
    roles = [[turn["role"] for turn in segment["turns"]] for segment in rewritten["segments"]]
    assert roles == [["assistant", "tool", "assistant"], ["assistant"]]
    assert [call["name"] for call in rewritten["segments"][0]["turns"][0]["tool_calls"]] == ["calculator"]
    # each model turn's own reward, per trajectory and beside its turn
    assert rewritten["turn_rewards"] == [0.25, 0.0, -0.5] and records[1]["turn_rewards"] == [0.0]
    rewards = [[turn.get("reward") for turn in segment["turns"]] for segment in rewritten["segments"]]
    assert rewards == [[0.25, None, 0.0], [-0.5]]
    assert rewritten["tool_calls"] == 1 and rewritten["num_turns"] == 5
    assert rewritten["advantage"] == 1.0 and records[1]["advantage"] == -1.0
    # stored once: the earlier segments beside the last one's columns
    stored = pq.read_table(path)
    assert stored.num_rows == 2 and [len(earlier) for earlier in stored.column("earlier_segments").to_pylist()] == [
        1,
        0,
    ]

    sample = RunStore(run_dir).sample(1, 0)
    assert [row["num_segments"] for row in RunStore(run_dir).step(1)["samples"]] == [2, 1]
    assert [segment["rewritten_by"] for segment in sample["segments"]] == [None, "summarize"]
    assert sample["tokens"]["policy_versions"] == [
        v for segment in outputs[0].all_segments() for v in segment.policy_versions
    ]
    second = sample["segments"][1]["turns"][0]  # its span is where the second segment's response starts in the tokens
    assert second["start"] == len(outputs[0].segments[0].response_ids) and second["end"] == len(
        sample["tokens"]["text"]
    )


def test_page_shows_segments_and_colours_tokens_by_policy_version(segments_run, page):
    browser = page
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    run_dir, outputs, _ = segments_run
    first, last = outputs[0].all_segments()
    with viewer(run_dir) as url:
        browser.get(url + "#/step/1/sample/0")
        segments = wait_until(
            lambda: browser.find_elements(By.CSS_SELECTOR, "#sample-view .segment"), "the sample's segments"
        )
        assert [segment.get_attribute("data-segment") for segment in segments] == ["0", "1"]
        assert segments[1].get_attribute("data-rewritten-by") == "summarize"
        assert not segments[0].find_elements(By.CSS_SELECTOR, ".segment-rewrite")
        assert "rewritten by summarize" in segments[1].find_element(By.CSS_SELECTOR, ".segment-rewrite").text
        for segment, part in zip(segments, (first, last)):
            assert len(segment.find_elements(By.CSS_SELECTOR, ".tok")) == len(part.response_ids)
            assert len(segment.find_elements(By.CSS_SELECTOR, "details.prompt")) == 1
        # a model turn that reported a reward shows it in its label
        labels = [
            label.text for label in browser.find_elements(By.CSS_SELECTOR, "#sample-view .turn-model .turn-label")
        ]
        assert [label.endswith(" · reward 0.25") for label in labels] == [True, False, False] and labels[2].endswith(
            "· reward -0.5"
        )

        Select(browser.find_element(By.ID, "colour-mode")).select_by_value("version")
        legend = browser.find_elements(By.CSS_SELECTOR, "#colour-legend .version-swatch")
        assert [swatch.get_attribute("data-version") for swatch in legend] == ["3", "4", "5"]
        spans = (
            "return [...document.querySelectorAll('#sample-view .tok-model[data-i]')]"
            ".map(s => [Number(s.dataset.i), getComputedStyle(s).backgroundColor])"
        )
        versions = first.policy_versions + last.policy_versions
        colours: dict[int, set[str]] = {}
        for i, colour in browser.execute_script(spans):
            colours.setdefault(versions[i], set()).add(colour)
        assert sorted(colours) == [3, 4, 5]
        assert all(len(shades) == 1 for shades in colours.values()), colours  # one colour per version...
        assert len({shade for shades in colours.values() for shade in shades}) == 3  # ... and each its own

        # the group side by side: the rewrite marked in the first trajectory's column only
        browser.get(url + "#/step/1/group/g0")
        members = wait_until(
            lambda: browser.find_elements(By.CSS_SELECTOR, "#group-view .group-sample"), "the group view"
        )
        assert [len(member.find_elements(By.CSS_SELECTOR, ".segment-rewrite")) for member in members] == [1, 0]
        assert console_problems(browser) == []
