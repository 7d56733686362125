"""Synthetic arithmetic problems in verl's row format, solved with a compute tool and submit_answer.

The compute tool is ``calculator`` (the quick start) or the sandboxed ``python_exec``
(``config/arithmetic_python_grpo.yaml``); only the system prompt names it.

    python -m agentloop.tasks.arithmetic.data --out data/arithmetic --train 512 --test 64
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from agentloop.models.cache import cache_root
from agentloop.rows import write_rows, write_rows_once

SYSTEM = {
    "calculator": "Use the calculator tool to compute, then call submit_answer with the result.",
    "python_exec": "Use the python_exec tool to compute (print the value), then call submit_answer with the result.",
}


def make_rows(
    count: int,
    seed: int = 0,
    split: str = "train",
    max_operand: int = 99,
    compute_tool: str = "calculator",
    agent_name: str = "tool_agent",
) -> list[dict[str, Any]]:
    """``count`` problems ``a op b`` with operands in ``[0, max_operand]`` (deterministic for a seed), each a
    row of ``agent_name`` whose system prompt asks for ``compute_tool`` (a key of ``SYSTEM``)."""
    if compute_tool not in SYSTEM:
        raise ValueError(f"arithmetic task: unknown compute_tool {compute_tool!r}; choose one of {sorted(SYSTEM)}")
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for index in range(count):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM[compute_tool]},
                    {"role": "user", "content": f"What is {a} {op} {b}?"},
                ],
                "agent_name": agent_name,
                "data_source": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "expression": f"{a} {op} {b}",
                    "tools_kwargs": {"submit_answer": {"create_kwargs": {"ground_truth": answer}}},
                },
            }
        )
    return rows


def cached_split(
    split: str,
    count: int,
    max_operand: int = 99,
    seed: int = 0,
    compute_tool: str = "calculator",
    agent_name: str = "tool_agent",
) -> str:
    """A cached parquet of ``make_rows(count, seed, split, max_operand, compute_tool, agent_name)``, written on first use."""
    # the quick start's cache keeps its name
    variant = ("" if compute_tool == "calculator" else f"-{compute_tool}") + (
        "" if agent_name == "tool_agent" else f"-{agent_name}"
    )
    path = cache_root() / "data" / f"arithmetic{variant}-{count}-{max_operand}-{seed}" / f"{split}.parquet"
    return write_rows_once(path, lambda: make_rows(count, seed, split, max_operand, compute_tool, agent_name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/arithmetic")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    parser.add_argument("--compute-tool", choices=sorted(SYSTEM), default="calculator")
    args = parser.parse_args()
    for split, count in (("train", args.train), ("test", args.test)):
        rows = make_rows(count, args.seed, split, compute_tool=args.compute_tool)
        print(write_rows(rows, f"{args.out}/{split}.{args.format}"))


if __name__ == "__main__":
    main()
