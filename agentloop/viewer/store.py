"""What a run directory holds, shaped for the viewer's pages; re-read whenever a file changes.

A run directory has ``metrics.jsonl`` (one line per step) and rollout dumps (``agentloop.dumps``) in
``rollouts/`` or in the directory itself. Nothing here raises on bad input: what cannot be read is
reported in ``problems`` and the rest is still served.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachetools import LRUCache

from agentloop.dumps import FORMAT, LEGACY_FORMAT, dump_format, list_step_files, read_rollout_dump
from agentloop.policy_versions import VersionRuns

TABLE_FIELDS = (
    "sample",
    "uid",
    "group",
    "index",
    "data_source",
    "agent_name",
    "reward",
    "advantage",
    "finish_reason",
    "num_turns",
    "num_segments",
    "response_length",
    "model_tokens",
    "tool_calls",
    "tool_errors",
    "generate_time_s",
)
TOKEN_ARRAYS = ("rollout_log_probs", "old_log_probs", "advantages")  # the per-token arrays the page colours by


class StepNotFound(LookupError):
    """A step, sample or group the run does not have; the message lists what it has."""


class RunStore:
    """Reads one run's metrics and dumps; each file is parsed again only when its size or mtime changes."""

    def __init__(self, path: str | Path, rollouts: str | Path | None = None) -> None:
        self.path = Path(path).resolve()
        self.rollouts = Path(rollouts).resolve() if rollouts else self._find_rollouts()
        # keyed by (path, mtime, size): a file that changes is read again
        self._parsed: LRUCache = LRUCache(maxsize=16)  # -> (format, records) | error text
        self._formats: dict[tuple[str, int, int], str | ValueError] = {}  # -> format | error (footers only)

    def _find_rollouts(self) -> Path:
        for candidate in (self.path / "rollouts", self.path):
            if list_step_files(candidate):
                return candidate
        return self.path / "rollouts"

    # ------------------------------------------------------------------ reading files

    @staticmethod
    def _key(path: Path) -> tuple[str, int, int]:
        stat = path.stat()
        return str(path), stat.st_mtime_ns, stat.st_size

    def _check(self, path: Path) -> None:
        """Raise ValueError when the dump cannot be read; cheap (footers only) and remembered per file version."""
        key = self._key(path)
        if key not in self._formats:
            try:
                self._formats[key] = dump_format(path)
            except ValueError as error:
                self._formats[key] = error
        if isinstance(self._formats[key], ValueError):
            raise self._formats[key]

    def _read(self, path: Path) -> tuple[str, list[dict[str, Any]]]:
        """A dump's (format, records); raises ValueError naming the problem."""
        key = self._key(path)
        if key not in self._parsed:
            try:
                format_name, records = read_rollout_dump(path)
            except ValueError as error:
                self._parsed[key] = str(error)
            else:
                # GRPO groups numbered in order of first appearance, once per file version
                numbers: dict[Any, int] = {}
                for record in records:
                    record["group"] = (
                        numbers.setdefault(record.get("uid"), len(numbers)) if format_name == FORMAT else None
                    )
                self._parsed[key] = format_name, records
        parsed = self._parsed[key]
        if isinstance(parsed, str):
            raise ValueError(parsed)
        return parsed

    def _metrics(self) -> tuple[list[dict[str, Any]], list[str]]:
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return [], [f"no metrics.jsonl in {self.path}: no curves"]
        lines, problems = [], []
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                still_writing = number == text.count("\n") + 1 and not text.endswith("\n")
                problems.append(
                    f"metrics.jsonl line {number}: not JSON" + ("; still being written?" if still_writing else "")
                )
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                lines.append(
                    {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                )
            else:
                problems.append(f"metrics.jsonl line {number}: not a metrics record with an integer 'step'")
        return lines, problems

    # ------------------------------------------------------------------ what the pages ask for

    def run(self) -> dict[str, Any]:
        """Steps with readable dumps, every metrics line, and what could not be read."""
        metrics, problems = self._metrics()
        steps = []
        files = list_step_files(self.rollouts)
        for step, path in files.items():
            try:
                self._check(path)
                steps.append(step)
            except (ValueError, OSError) as error:
                problems.append(f"step {step}: {error}")
        writing = list(self.rollouts.glob(".step_*.tmp"))
        found = (
            f"{len(steps)} step(s) of rollout dumps in {self.rollouts}"
            if steps
            else f"no rollout dumps found in {self.rollouts} (step_NNNNNN.parquet, or verl's N.jsonl); "
            "set trainer.rollout_data_dir, or pass --rollouts DIR"
        )
        found += f", {len(metrics)} line(s) of metrics" + (f", {len(writing)} step(s) being written" if writing else "")
        return {
            "path": str(self.path),
            "title": self.path.name,
            "live": True,
            "found": found,
            "problems": problems,
            "steps": steps,
            "metrics": metrics,
        }

    def _records(self, step: int) -> tuple[str, list[dict[str, Any]]]:
        files = list_step_files(self.rollouts)
        if step not in files:
            raise StepNotFound(f"step {step} has no rollout dump in {self.rollouts}; steps with dumps: {sorted(files)}")
        return self._read(files[step])

    def step(self, step: int) -> dict[str, Any]:
        """The step's sample table."""
        format_name, records = self._records(step)
        samples = [self._sample(record, position, format_name) for position, record in enumerate(records)]
        return {
            "step": step,
            "format": format_name,
            "problems": [],
            "samples": [{key: sample.get(key) for key in TABLE_FIELDS} for sample in samples],
        }

    def sample(self, step: int, sample: int) -> dict[str, Any]:
        """One sample with its turns, tokens, reward parts and the rest of its fields."""
        format_name, records = self._records(step)
        if not 0 <= sample < len(records):
            raise StepNotFound(f"step {step} has samples 0..{len(records) - 1}, not {sample}")
        return self._sample(records[sample], sample, format_name)

    def group(self, step: int, uid: str) -> dict[str, Any]:
        """Every sample of one GRPO group (samples sharing ``uid``)."""
        format_name, records = self._records(step)
        members = [self._sample(r, i, format_name) for i, r in enumerate(records) if r.get("uid") == uid]
        if not members:
            raise StepNotFound(f"step {step} has no group {uid!r}")
        return {"step": step, "uid": uid, "samples": members}

    @staticmethod
    def _sample(record: dict[str, Any], position: int, format_name: str) -> dict[str, Any]:
        """A trajectory for the page: ``tokens`` run through all its segments' responses in order, and each of
        ``segments`` has its context's text, what rewrote it, and its turns with spans into ``tokens``."""
        if format_name == LEGACY_FORMAT:
            return _legacy_sample(record, position)
        row = record.get("row") or {}
        segments = record["segments"]
        return {
            **{key: record.get(key) for key in TABLE_FIELDS},
            "sample": position,
            "reward": record.get("score"),
            "turn_rewards": record.get("turn_rewards"),  # each model turn's own (None: a dump written before them)
            "num_segments": len(segments),
            "prompt_messages": row.get("prompt"),
            "ground_truth": (row.get("reward_model") or {}).get("ground_truth")
            if isinstance(row.get("reward_model"), dict)
            else None,
            "tokens": _tokens(segments),
            "segments": _segments(segments),
            "reward_parts": record.get("reward_parts") or {},
            "extra": {
                **(record.get("extra") or {}),
                "extra_info": row.get("extra_info"),
                "request_id": record.get("request_id"),
            },
        }


def _tokens(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The segments' response tokens one after another: text, mask, each policy version (-1: observation or
    unknown) and the per-token arrays (None where a segment lacks one: a dump written before it had them)."""

    def joined(key: str) -> list[Any] | None:
        parts = [segment.get(key) for segment in segments]
        return None if any(part is None for part in parts) else [value for part in parts for value in part]

    runs = joined("policy_version_runs")
    return {
        "text": joined("token_text"),
        "mask": joined("response_mask"),
        "policy_versions": None if runs is None else VersionRuns(runs).per_token(),
        **{name: joined(name) for name in TOKEN_ARRAYS},
    }


def _segments(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each segment's context text, ``rewritten_by`` and turns, the turns' spans moved to where its response starts
    in the trajectory's ``tokens``."""
    shown, offset = [], 0
    for segment in segments:
        turns = [
            {**turn, "start": turn["start"] + offset, "end": turn["end"] + offset}
            for turn in segment.get("turns") or []
        ]
        shown.append({"rewritten_by": segment.get("rewritten_by"), "prompt_text": segment.get("input"), "turns": turns})
        offset += len(segment["token_text"])
    return shown


def _legacy_sample(record: dict[str, Any], position: int) -> dict[str, Any]:
    """verl's text-only dump line: prompt and response text and score, nothing per token."""
    output = str(record.get("output", ""))
    sample = {key: None for key in TABLE_FIELDS}
    turns = [{"role": "assistant", "start": 0, "end": 0, "text": output, "tool_calls": []}]
    sample.update(
        sample=position,
        index=record.get("index"),
        reward=record.get("score"),
        num_segments=1,
        prompt_messages=None,
        ground_truth=record.get("gts"),
        tokens=None,
        reward_parts={},
        segments=[{"rewritten_by": None, "prompt_text": record.get("input"), "turns": turns}],
        extra={key: value for key, value in record.items() if key not in ("input", "output")},
    )
    return sample
