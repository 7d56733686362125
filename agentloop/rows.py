"""Dataset rows in verl's format: the one check every entry point applies, and writing rows to disk.

A row has ``prompt`` (chat messages) and optionally ``agent_name``, ``data_source``, ``reward_model``
and ``extra_info`` (``index``, ``tools_kwargs``, ``interaction_kwargs``, ...); other fields ride along.
Before its loop runs, a row also gets verl's derived fields (``verl_row_fields``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from agentloop.protocol import BATCH_FIELDS, SCORE_FIELDS

# the non_tensor_batch columns a rollout fills per sample; a row field of one of these names would be overwritten
OUTPUT_COLUMNS = (*BATCH_FIELDS, *SCORE_FIELDS, "generate_time_s", "policy_version", "rewritten_by")


def check_row(row: Any, where: str) -> None:
    """A row must be a mapping whose ``prompt`` is a non-empty list of ``{role, content}`` messages, with no field
    that the rollout fills per sample (``OUTPUT_COLUMNS``)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(row).__name__}")
    taken = [key for key in OUTPUT_COLUMNS if key in row]
    if taken:
        raise ValueError(
            f"{where}: field {taken[0]!r} is a column the rollout fills for each sample ({', '.join(OUTPUT_COLUMNS)}), "
            "so the batch would lose the row's value: rename it, or move it under extra_info"
        )
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {prompt!r:.200}")
    for position, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"{where}: prompt[{position}] must be a {{role, content}} message, got {message!r:.200}")


def verl_row_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The fields verl's dataset adds to every row before its agent loop runs: ``raw_prompt`` (the chat
    messages), ``index`` (``extra_info.index``), and ``tools_kwargs`` / ``interaction_kwargs`` lifted
    from ``extra_info``. A row that already has one of them keeps its own."""
    extra_info = row.get("extra_info") or {}
    return {
        "raw_prompt": row.get("raw_prompt") or row["prompt"],
        "index": extra_info.get("index"),
        "tools_kwargs": row.get("tools_kwargs") or extra_info.get("tools_kwargs") or {},
        "interaction_kwargs": row.get("interaction_kwargs") or extra_info.get("interaction_kwargs") or {},
    }


def write_rows(rows: list[dict[str, Any]], path: str) -> str:
    """Write rows as parquet (``.parquet``) or JSON lines (anything else); return the path."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    if file.suffix == ".parquet":
        # pyarrow takes the columns from the first row alone: give every row every field
        fields = list(dict.fromkeys(key for row in rows for key in row))
        pq.write_table(pa.Table.from_pylist([{key: row.get(key) for key in fields} for row in rows]), file)
    else:
        file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(file)


def write_rows_once(path: Path, make_rows: Callable[[], list[dict[str, Any]]]) -> str:
    """``path``, writing ``make_rows()`` there first if nothing is there yet (a cache of built data). Each writer
    writes its own copy and renames it into place, so concurrent builders never leave a partial file."""
    if not path.exists():
        os.replace(write_rows(make_rows(), str(path.with_suffix(f".{os.getpid()}{path.suffix}"))), path)
    return str(path)
