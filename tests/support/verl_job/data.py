"""GSM8K-format rows exactly as verl's ``examples/data_preprocess/gsm8k_multiturn_w_tool.py`` and
``..._w_interaction.py`` write them (synthetic word problems: nothing is downloaded)."""

from __future__ import annotations

import random
from typing import Any

from agentloop.rows import write_rows

INSTRUCTION = "Let's think step by step and output the final answer after `####`."
TOOL_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by "
    "step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the "
    "question, before generate final answer at least once and refine your answer if necessary. Put your final "
    "answer in the format of `#### <answer>`."
)
INTERACTION_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. You should "
    "rethinking carefully if user point out your answer is wrong. Put your final answer in the format of `#### <answer>`."
)


def problems(count: int, seed: int) -> list[tuple[str, str, str]]:
    """``(question, worked answer ending in '#### N', N)`` word problems."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        apples, bought = rng.randint(2, 40), rng.randint(2, 40)
        total = apples + bought
        out.append(
            (
                f"Tom has {apples} apples and buys {bought} more. How many apples does he have?",
                f"Tom has {apples} + {bought} = <<{apples}+{bought}={total}>>{total} apples.\n#### {total}",
                str(total),
            )
        )
    return out


def gsm8k_rows(split: str, count: int, seed: int, system: str, extra_info: Any) -> list[dict[str, Any]]:
    """The rows both preprocessing scripts write; ``extra_info(question, solution)`` gives each variant's own fields."""
    rows = []
    for index, (question_raw, answer_raw, solution) in enumerate(problems(count, seed)):
        question = question_raw + " " + INSTRUCTION
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "answer": answer_raw,
                    "question": question_raw,
                    **extra_info(question, solution),
                },
            }
        )
    return rows


def tool_rows(split: str, count: int, seed: int) -> list[dict[str, Any]]:
    return gsm8k_rows(
        split,
        count,
        seed,
        TOOL_SYSTEM,
        lambda question, solution: {
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            # written for tool-only jobs too; no interaction is configured there
            "interaction_kwargs": {"query": question, "ground_truth": solution},
        },
    )


def interaction_rows(split: str, count: int, seed: int) -> list[dict[str, Any]]:
    return gsm8k_rows(
        split,
        count,
        seed,
        INTERACTION_SYSTEM,
        lambda question, solution: {
            "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": solution},
        },
    )


def write_split(directory: str, kind: str, split: str, count: int, extra_rows: list[dict[str, Any]] = ()) -> str:
    build = tool_rows if kind == "tool" else interaction_rows
    seed = {"train": 0, "test": 1}[split]
    return write_rows(build(split, count, seed) + list(extra_rows), f"{directory}/{split}.parquet")
