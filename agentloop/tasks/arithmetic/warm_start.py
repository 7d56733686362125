"""The supervised warm start of the quick start: the tiny model taught the arithmetic tool task, partly.

A random tiny model never calls a tool, so GRPO would see reward 0 everywhere and learn nothing. The
warm start teaches both behaviours on the task's own prompts (same system prompt, same tool schemas
from the job's ``multi_turn.tool_config_path``): in a ``tool_share`` of the conversations the model calls
``calculator``, then ``submit_answer`` with the result (reward 1); in the rest it answers in plain text
without tools (reward 0). The compute call is ``calculator(expression)``, or ``python_exec`` with
``print(expression)`` when the job's tool set has ``python_exec`` (its observation is what the sandbox
prints, the same text). The first pass teaches the protocol on every problem, long enough for the model to
copy the operands into its call and the result into its answer; the second leaves the starting policy using
the tools on a small share of the problems (a mean reward of 0.19 at temperature 1 with ``tool_share=0.25``),
and reinforcement has one clear thing to learn: use the tools.

With ``long_episodes`` the solution takes four model turns instead of three, each with a sentence of text: compute,
check with a second call, submit, close (about three times the response tokens). ``benchmarks/vs_trl.py`` trains
it as its longer-episode workload; the reward is the same.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from transformers import AutoTokenizer

from agentloop.models.cache import cache_root
from agentloop.models.sft import finetune
from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.tasks.arithmetic.data import make_rows
from agentloop.tasks.arithmetic.tools import evaluate
from agentloop.tools.parsers import format_hermes
from agentloop.tools.toolset import load_tool_set


def conversation(
    row: dict[str, Any],
    use_tools: bool,
    rng: random.Random,
    compute_tool: str = "calculator",
    long_episodes: bool = False,
) -> list[dict[str, Any]]:
    """One chat for ``row``: the tool-using solution (computing with ``compute_tool``), or a plain-text guess."""
    messages = list(row["prompt"])
    if not use_tools:
        return messages + [{"role": "assistant", "content": f"The answer is {rng.randint(-99, 999)}."}]
    expression = row["extra_info"]["expression"]
    value = evaluate(expression)
    arguments = {"code": f"print({expression})"} if compute_tool == "python_exec" else {"expression": expression}
    if long_episodes:
        return messages + [
            {
                "role": "assistant",
                "content": f"First compute {expression} with the {compute_tool}.\n"
                + format_hermes(compute_tool, arguments),
            },
            {"role": "tool", "content": str(value)},
            {
                "role": "assistant",
                "content": f"The result is {value}. Then check the result with one more call.\n"
                + format_hermes(compute_tool, arguments),
            },
            {"role": "tool", "content": str(value)},
            {
                "role": "assistant",
                "content": f"The value equals {value} again, so submit the final answer {value}.\n"
                + format_hermes("submit_answer", {"answer": value}),
            },
            {"role": "tool", "content": "correct"},
            {"role": "assistant", "content": f"Done: {expression} equals {value}, and the answer is correct."},
        ]
    return messages + [
        {"role": "assistant", "content": format_hermes(compute_tool, arguments)},
        {"role": "tool", "content": str(value)},
        {"role": "assistant", "content": format_hermes("submit_answer", {"answer": value})},
        {"role": "tool", "content": "correct"},
        {"role": "assistant", "content": "Done."},
    ]


def warm_start_path(
    tools_path: str, max_operand: int = 9, tool_share: float = 0.25, seed: int = 0, long_episodes: bool = False
) -> str:
    """Directory of the warm-started checkpoint, trained on first use and cached (deterministic).

    ``tools_path`` is the job's tool YAML: the conversations render its schemas, as rollouts will.
    Two passes: first the tool protocol on every problem (copying operands into the call and the
    result into the answer takes a few hundred steps to click), then a short pass where each problem
    comes with tools in ``tool_share`` of its conversations, which sets how often the starting policy
    uses them, whatever the problem.
    """
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    schemas = load_tool_set(tools_path).schemas
    compute_tool = (
        "python_exec" if any(schema["function"]["name"] == "python_exec" for schema in schemas) else "calculator"
    )
    rng = random.Random(seed)
    # problems of their own split: the warm start never sees the train or test rows
    rows = make_rows(512, seed, split="warm_start", max_operand=max_operand, compute_tool=compute_tool)
    per_problem = 4

    def render(row: dict[str, Any], use_tools: bool) -> str:
        chat = conversation(row, use_tools, rng, compute_tool, long_episodes)
        return tokenizer.apply_chat_template(chat, tools=schemas, tokenize=False)

    skill = [render(row, True) for row in rows]
    mix = [render(row, i < round(tool_share * per_problem)) for row in rows[:128] for i in range(per_problem)]
    models = cache_root() / "models"
    # 600 steps left the copying half learnt on some CPUs (float sums differ by machine): operands right in 45 of 64
    # greedy calls, results in 27, and GRPO plateaued at a reward of about 0.3; after 1200 steps, 64 and 61 there
    skill_training = {"steps": 1200, "lr": 3e-3, "batch_size": 16}
    skilled = finetune(
        base,
        skill,
        str(models / f"arithmetic-tools-{_key(base, skill, skill_training)}"),
        **skill_training,
        seed=seed,
        desc="warm start 1/2 (first run only): the tool protocol",
    )
    mix_training = {"steps": 100, "lr": 1e-3, "batch_size": 16}
    return finetune(
        skilled,
        mix,
        str(models / f"arithmetic-warm-start-{_key(skilled, mix, mix_training)}"),
        **mix_training,
        seed=seed,
        desc=f"warm start 2/2 (first run only): tools in {tool_share:.0%} of the conversations",
    )


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
