"""Dataset rows in verl's format: the one check every entry point applies, and writing rows to disk.

A row has ``prompt`` (chat messages) and optionally ``agent_name``, ``data_source``, ``reward_model``
and ``extra_info`` (``index``, ``tools_kwargs``, ``interaction_kwargs``, ...); other fields ride along.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def check_row(row: Any, where: str) -> None:
    """A row must be a mapping whose ``prompt`` is a non-empty list of ``{role, content}`` messages."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {prompt!r:.200}")
    for position, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"{where}: prompt[{position}] must be a {{role, content}} message, got {message!r:.200}")


def write_rows(rows: list[dict[str, Any]], path: str) -> str:
    """Write rows as parquet (``.parquet``) or JSON lines (anything else); return the path."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    if file.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), file)
    else:
        file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(file)
