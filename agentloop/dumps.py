"""Rollout dumps: one Parquet file per step holding every trajectory's tokens, turns, rewards and tool calls.

The trainer writes one per step into ``trainer.rollout_data_dir``; any ``generate_sequences`` caller can
write one with ``write_rollout_dump``. ``agentloop.viewer`` reads them. A step's file is written under a
hidden temporary name and renamed when complete, so a reader of a running job's directory never sees
half of a step.

One record per trajectory (a batch has one row per segment: ``agentloop.postprocess``). Per trajectory: verl's
``step`` and ``score``; its position (``sample``), GRPO group (``uid``), dataset ``index`` and row fields (``row``,
JSON); the ``policy_version`` its group started under (updates applied; set by the trainer); ``finish_reason`` (the
trajectory's ``end_reason``), ``num_turns``, and counts over all its segments for tables (``response_length``,
``model_tokens``, ``tool_calls``, ``tool_errors``); ``turn_rewards`` (each model turn's own reward,
``TurnRecord.reward``: what its tools, the interaction or the environment reported for it); ``reward_parts`` (JSON: the
reward, its source, its parts by source, the interaction's turn scores and what a reward function returned) and
``extra`` (JSON: the loop's ``extra_fields``, its metrics, and its tool errors and env retries by kind, failure, the
judge's calls (``judge_calls``: prompt, reply, tokens, seconds, error) and missing rollout log-probs where it has them).

Per segment (``SEGMENT_COLUMNS``): ``rewritten_by`` (the context strategy that made its context; None for the first),
verl's ``input`` and ``output`` (its context and response, decoded), the exact ``prompt_ids``, ``response_ids``,
``response_mask``, one decoded string per response token (``token_text``), ``turns`` (JSON: role, token span, text and
tool calls with arguments, result, latency and error per turn, and a model turn's own ``reward``),
``policy_version_runs`` (each response token's policy version as ``[version, count]`` runs,
``agentloop.policy_versions.VersionRuns``; -1 on observation tokens) and the per-token float arrays
(``rollout_log_probs``, plus what the caller adds: the trainer adds ``old_log_probs``, ``advantages`` and, when
computed, ``ref_log_probs``). The top-level columns hold the trajectory's last segment (its
only one, unless a context strategy rewrote its context), ``earlier_segments`` the ones before it, oldest first, with
the same keys; ``read_rollout_dump`` lists them all as ``segments``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from agentloop.protocol import TurnRecord
from agentloop.turn_totals import env_retries_by_kind, tool_errors_by_kind, turn_scores
from agentloop.rows import OUTPUT_COLUMNS  # what the rollout adds per sample; everything else is a row field

if TYPE_CHECKING:  # the reading half (the viewer) runs without torch, tensordict and transformers
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentloop.batch import RolloutBatch

FORMAT = "agentloop-rollouts/1"  # segments added columns only: a file written before them reads as one segment
LEGACY_FORMAT = "verl-jsonl (text only)"
STEP_FILE = re.compile(r"^step_(\d+)\.parquet$")
JSON_COLUMNS = ("row", "turns", "reward_parts", "extra")
TOKEN_ARRAY = pa.list_(pa.float32())  # a per-token array's column type (rollout_log_probs and the caller's)

TRAJECTORY_COLUMNS = [
    ("step", pa.int64()),
    ("sample", pa.int32()),
    ("uid", pa.string()),
    ("index", pa.string()),
    ("data_source", pa.string()),
    ("agent_name", pa.string()),
    ("request_id", pa.string()),
    ("score", pa.float64()),
    ("advantage", pa.float64()),
    ("finish_reason", pa.string()),
    ("num_turns", pa.int32()),
    ("response_length", pa.int32()),
    ("model_tokens", pa.int32()),
    ("tool_calls", pa.int32()),
    ("tool_errors", pa.int32()),
    ("turn_rewards", pa.list_(pa.float64())),
    ("generate_time_s", pa.float64()),
    ("policy_version", pa.int64()),
    ("row", pa.string()),
    ("reward_parts", pa.string()),
    ("extra", pa.string()),
]
SEGMENT_COLUMNS = [
    ("rewritten_by", pa.string()),
    ("input", pa.string()),
    ("output", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("response_mask", pa.list_(pa.int8())),
    ("token_text", pa.list_(pa.string())),
    ("turns", pa.string()),
    ("policy_version_runs", pa.list_(pa.list_(pa.int64()))),
]


def write_rollout_dump(
    directory: str | Path,
    step: int,
    batch: RolloutBatch,
    tokenizer: PreTrainedTokenizerBase,
    **token_arrays: torch.Tensor,
) -> Path:
    """Write ``directory/step_NNNNNN.parquet`` for a finished batch, one record per trajectory; return its path.

    ``token_arrays`` are extra per-token tensors of shape (B, response_length), e.g. the trainer's
    ``old_log_probs`` and ``advantages``; each becomes a column cut to each segment's response.
    """
    from agentloop.batch import trajectory_ids  # imported here: reading a dump needs no torch

    arrays = {"rollout_log_probs": batch.batch["rollout_log_probs"], **token_arrays}
    rows_of: dict[int, list[int]] = {}
    for row, trajectory in enumerate(trajectory_ids(batch.batch["segment_index"]).tolist()):
        rows_of.setdefault(trajectory, []).append(row)
    records = [_trajectory_record(batch, rows, sample, step, tokenizer, arrays) for sample, rows in rows_of.items()]
    segment = [*SEGMENT_COLUMNS, *((name, TOKEN_ARRAY) for name in arrays)]
    schema = pa.schema([*TRAJECTORY_COLUMNS, *segment, ("earlier_segments", pa.list_(pa.struct(segment)))])
    table = pa.Table.from_pylist(records, schema=schema.with_metadata({"format": FORMAT}))
    path = Path(directory) / f"step_{step:06d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, temporary, compression="zstd")
    os.replace(temporary, path)
    return path


def _trajectory_record(
    batch: RolloutBatch,
    rows: list[int],
    sample: int,
    step: int,
    tokenizer: PreTrainedTokenizerBase,
    arrays: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """One trajectory (its segments are ``rows``, oldest first); its per-trajectory columns repeat on every row, and
    are read from its last."""
    fields, last = batch.non_tensor_batch, rows[-1]
    loop_turns: list[TurnRecord] = _field(fields, "turns", last) or []
    # the loop's turns and observation roles run through the segments in order
    model_turns = iter([turn for turn in loop_turns if turn.model_tokens])
    observation_roles = iter(_field(fields, "observation_roles", last) or [])
    segments = [_segment(batch, row, tokenizer, arrays, model_turns, observation_roles) for row in rows]
    mask = [value for segment in segments for value in segment["response_mask"]]
    advantage = None
    if "advantages" in arrays and sum(mask):
        advantages = [value for segment in segments for value in segment["advantages"]]
        advantage = float(np.dot(advantages, mask) / sum(mask))
    row = {key: _field(fields, key, last) for key in fields if key not in OUTPUT_COLUMNS}
    return {
        "step": step,
        "sample": sample,
        "uid": _text(row.get("uid")),
        "index": _text(row.get("index")),
        "data_source": _text(row.get("data_source")),
        "agent_name": _text(row.get("agent_name")),
        "request_id": _text(row.get("request_id")),
        "score": float(batch.batch["rm_scores"][rows].sum()),  # only the last row holds the reward
        "advantage": advantage,
        "finish_reason": _field(fields, "end_reason", last),
        "num_turns": _field(fields, "num_turns", last),
        "response_length": len(mask),
        "model_tokens": int(sum(mask)),
        "tool_calls": sum(len(turn.calls) for turn in loop_turns),
        "tool_errors": sum(turn.tool_errors for turn in loop_turns),
        "turn_rewards": [turn.reward for turn in loop_turns],
        "generate_time_s": _field(fields, "generate_time_s", last),
        "policy_version": _field(fields, "policy_version", last),
        "row": _json(row),
        "reward_parts": _json(_reward(fields, last, loop_turns)),
        "extra": _json(_extra(fields, last, loop_turns)),
        **segments[-1],
        "earlier_segments": segments[:-1],
    }


def _segment(
    batch: RolloutBatch,
    i: int,
    tokenizer: PreTrainedTokenizerBase,
    arrays: dict[str, torch.Tensor],
    model_turns: Iterator[TurnRecord],
    observation_roles: Iterator[str],
) -> dict[str, Any]:
    """Row ``i``'s segment: ``SEGMENT_COLUMNS`` and the per-token arrays, cut to its own prompt and response."""
    tensors = batch.batch
    prompt_width = tensors["prompts"].shape[1]
    attention = tensors["attention_mask"][i].bool()
    prompt_ids = tensors["prompts"][i][attention[:prompt_width]].tolist()
    length = int(attention[prompt_width:].sum())
    response_ids = tensors["responses"][i, :length].tolist()
    mask = tensors["response_mask"][i, :length].tolist()
    versions, counts = tensors["rollout_policy_versions"][i, :length].unique_consecutive(return_counts=True)
    return {
        "rewritten_by": _field(batch.non_tensor_batch, "rewritten_by", i),
        "input": tokenizer.decode(prompt_ids),
        "output": tokenizer.decode(response_ids),
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "response_mask": mask,
        "token_text": tokenizer.batch_decode([[token] for token in response_ids]),
        "turns": _json(_turns(tokenizer, response_ids, mask, observation_roles, model_turns)),
        "policy_version_runs": [[version, count] for version, count in zip(versions.tolist(), counts.tolist())],
        **{name: tensor[i, :length].float().tolist() for name, tensor in arrays.items()},
    }


def _reward(fields: dict[str, np.ndarray], i: int, loop_turns: list[TurnRecord]) -> dict[str, Any]:
    """The sample's reward, where it came from and what it was made of (what the sample has of it)."""
    parts = _field(fields, "reward_parts", i)
    reported = {
        "reward_source": _field(fields, "reward_source", i),
        "reward_parts": parts.by_source() if parts is not None else None,
        "turn_scores": turn_scores(loop_turns),
        "reward_extra_info": _field(fields, "reward_extra_info", i),
    }
    return {
        "reward_score": _field(fields, "reward_score", i),
        **{key: value for key, value in reported.items() if value},
    }


def _extra(fields: dict[str, np.ndarray], i: int, loop_turns: list[TurnRecord]) -> dict[str, Any]:
    """The loop's ``extra_fields`` and metrics, with the rest of its records that the sample has."""
    failure = _field(fields, "failure", i)
    reported = {
        "tool_errors": tool_errors_by_kind(loop_turns),
        "env_retries": env_retries_by_kind(loop_turns),
        "failure": dataclasses.asdict(failure) if failure is not None else None,
        "judge_calls": [dataclasses.asdict(call) for call in _field(fields, "judge_calls", i) or []],
        "rollout_log_probs_missing": _field(fields, "rollout_log_probs_missing", i),
    }
    extra = dict(_field(fields, "extra_fields", i) or {})
    return {
        **extra,
        **{key: value for key, value in reported.items() if value},
        "metrics": _field(fields, "metrics", i),
    }


def _turns(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    mask: list[int],
    observation_roles: Iterator[str],
    model_turns: Iterator[TurnRecord],
) -> list[dict[str, Any]]:
    """Split a segment's response into runs of model tokens and of observation tokens, one turn each.

    Model runs take the loop's own record of each turn with tokens (tool calls, reward) in order; observation runs take
    the roles the trajectory recorded (``tool``, ``user``), else ``observation``. Both iterators go on from one
    segment of a trajectory to the next.
    """
    turns = []
    for value, start, end in mask_runs(mask):
        if value:
            record = next(model_turns, None)
            calls = [dataclasses.asdict(call) for call in record.calls] if record else []
            turn = {"role": "assistant", "tool_calls": calls, "reward": record.reward if record else None}
        else:
            turn = {"role": next(observation_roles, "observation"), "tool_calls": []}
        turns.append({**turn, "start": start, "end": end, "text": tokenizer.decode(ids[start:end])})
    return turns


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in a response mask: model turns and observations."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def _field(fields: dict[str, np.ndarray], key: str, i: int) -> Any:
    value = fields[key][i] if key in fields else None
    return value.item() if isinstance(value, np.generic) else value


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _json(value: Any) -> str:
    return json.dumps(value, default=_jsonable, ensure_ascii=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


def list_step_files(directory: str | Path) -> dict[int, Path]:
    """Step number -> dump file in ``directory``: this format's files, and verl's ``<step>.jsonl``."""
    found: dict[int, Path] = {}
    for path in sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []:
        match = STEP_FILE.match(path.name)
        if match:
            found[int(match.group(1))] = path
        elif path.suffix == ".jsonl" and path.stem.isdigit():
            found.setdefault(int(path.stem), path)
    return dict(sorted(found.items()))


def dump_format(path: str | Path) -> str:
    """A dump file's format, read from its footer only; raises ``ValueError`` naming the problem for a file that
    cannot be read (half-written, another format or version)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        _read_jsonl(path)
        return LEGACY_FORMAT
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path.name}: could not read it as Parquet ({error}); still being written?") from error
    written_as = metadata.get(b"format", b"").decode()
    if written_as != FORMAT:
        raise ValueError(
            f"{path.name}: written as {written_as or 'an unknown format'!r}; this version reads {FORMAT!r}"
        )
    return FORMAT


def read_rollout_dump(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """(format, one dict per trajectory) of a dump file, JSON columns decoded; raises like ``dump_format``.

    Each trajectory's ``segments`` lists all its segments, oldest first (``earlier_segments`` and its last, the
    top-level columns), each a dict of ``SEGMENT_COLUMNS`` and the per-token arrays; a file written before segments
    has the keys it had (``rewritten_by`` and ``policy_version_runs`` None). verl's text-only ``<step>.jsonl`` reads
    as format ``verl-jsonl (text only)``, records as they are.
    """
    path = Path(path)
    if dump_format(path) == LEGACY_FORMAT:
        return LEGACY_FORMAT, _read_jsonl(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path.name}: could not read it as Parquet ({error}); still being written?") from error
    segment_keys = [
        *(name for name, _ in SEGMENT_COLUMNS),
        *(field.name for field in table.schema if field.type == TOKEN_ARRAY),
    ]
    records = table.to_pylist()
    for record in records:
        for key in JSON_COLUMNS:
            record[key] = json.loads(record[key]) if record.get(key) else None
        segments = [*(record.pop("earlier_segments", None) or []), {key: record.get(key) for key in segment_keys}]
        for segment in segments[:-1]:
            segment["turns"] = json.loads(segment["turns"]) if segment.get("turns") else None
        record["segments"] = segments
    return FORMAT, records


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path.name}: not valid JSON lines ({error}); still being written?") from error
