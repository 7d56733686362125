"""The test models: the tiny model fine-tuned to replay scripted tool-calling conversations, or to say "ok".

The models are real (same architecture, same engine); only their weights were taught the scripts, so
the agent loops meet exactly the turns a test needs under greedy decoding. Observations in the training
text come from the real parser and tools, so the model sees at rollout time what it saw in training.

Built once per test session before any test runs (``conftest.py`` runs this module as a bounded
subprocess: ``python -m tests.support.models tiny scripted ok``), then read from the cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any, NamedTuple

from transformers import AutoTokenizer

from agentloop.interactions import load_interactions
from agentloop.models.cache import cache_root
from agentloop.models.sft import finetune
from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.models.tiny_reward_model import tiny_reward_model_path
from agentloop.models.tiny_vlm import tiny_vlm_path
from agentloop.tasks.corridor.warm_start import warm_start_path as corridor_warm_start
from agentloop.tools.parsers import format_hermes as call
from agentloop.tools.parsers import parse_hermes
from agentloop.tools.toolset import load_tool_set
from tests.support.verl_job import data as verl_data

TOOLS_PATH = str(Path(__file__).with_name("scripted_tools.yaml"))
# Training stops once greedy decoding replays every text with this lead (in logits) of each trained
# token over the runner-up: far above the engine's numerical noise (~1e-5), and cheaper than a fixed step count.
STOP_MARGIN = 2.0


# script name -> the assistant turns the model must replay (tool results come from the real tools)
SCRIPTS: dict[str, list[str]] = {
    "multi": [call("calculator", {"expression": "2 + 3"}), call("submit_answer", {"answer": 5}), "The answer is 5."],
    "parallel": [
        call("calculator", {"expression": "1 + 1"}) + "\n" + call("calculator", {"expression": "3 * 3"}),
        "Done.",
    ],
    "think": [f"<think>\nmaybe {call('calculator', {'expression': '1 + 1'})}\n</think>\n\nNo tool needed."],
    "unknown": [call("weather", {"city": "Paris"}), "Done."],
    "malformed": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>', "Done."],
    "badargs": [call("calculator", {"expr": "1"}), "Done."],
    "raises": [call("explode", {}), "Done."],
    "slow": [call("sleepy", {}), "Done."],
    "loop": [call("calculator", {"expression": f"{n} + {n}"}) for n in (1, 2, 4)] + ["Done."],
    "echo": [call("echo", {"text": "abcdefgh ", "times": 12}), "Done."],
}
CREATE_KWARGS = {"submit_answer": {"ground_truth": 5}}


def script_row(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": f"script {name}"}],
        "agent_name": "tool_agent",
        "extra_info": {"tools_kwargs": {tool: {"create_kwargs": kw} for tool, kw in CREATE_KWARGS.items()}},
        **fields,
    }


async def _conversation(name: str, tools_path: str) -> list[dict[str, Any]]:
    tool_set = load_tool_set(tools_path)
    messages = list(script_row(name)["prompt"])
    created: dict[str, asyncio.Future] = {}
    for turn in SCRIPTS[name]:
        messages.append({"role": "assistant", "content": turn})
        _, calls = parse_hermes(turn)
        results = [await tool_set.call(c, f"script-{name}", created, CREATE_KWARGS) for c in calls]
        messages += [{"role": "tool", "content": result.text} for result in results]
    await tool_set.finish(f"script-{name}", created)
    return messages


class ScriptedModel(NamedTuple):
    tools_path: str
    path: str
    conversations: dict[str, list[dict[str, Any]]]


def build_scripted_model() -> ScriptedModel:
    """The fine-tuned model's directory, the tool YAML it was trained with, and each script's conversation."""
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    schemas = load_tool_set(TOOLS_PATH).schemas
    conversations = {name: asyncio.run(_conversation(name, TOOLS_PATH)) for name in SCRIPTS}
    texts = [tokenizer.apply_chat_template(c, tools=schemas, tokenize=False) for c in conversations.values()]
    key = hashlib.sha256(json.dumps([base, texts, STOP_MARGIN]).encode()).hexdigest()[:16]
    path = finetune(
        base,
        texts,
        str(cache_root() / "models" / f"scripted-{key}"),
        steps=400,
        stop_margin=STOP_MARGIN,
        desc="scripted test model",
    )
    return ScriptedModel(TOOLS_PATH, path, conversations)


def build_ok_model() -> str:
    """A model that answers every turn with "ok": short, eos-terminated turns for env and user loops."""
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(0)
    words = "keep going observation step try again history lots of text late reset start move left right".split()
    texts = []
    for _ in range(40):
        messages = []
        for _ in range(rng.randint(1, 4)):
            content = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) + f" {rng.randint(0, 50)}"
            messages += [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    key = hashlib.sha256(json.dumps([base, texts, STOP_MARGIN]).encode()).hexdigest()[:16]
    return finetune(
        base,
        texts,
        str(cache_root() / "models" / f"ok-{key}"),
        steps=150,
        stop_margin=STOP_MARGIN,
        desc='"ok" test model',
    )


# verl's GSM8K multi-turn example (tests/support/verl_job): its tool and interaction YAMLs, with the package renamed
VERL_JOB_CONFIG = Path(__file__).with_name("verl_job") / "config"
GSM8K_TOOLS_PATH = str(VERL_JOB_CONFIG / "tool_config/gsm8k_tool_config.yaml")
GSM8K_INTERACTIONS_PATH = str(VERL_JOB_CONFIG / "interaction_config/gsm8k_interaction_config.yaml")
GSM8K_ROWS_SEED = 11


def gsm8k_example_rows() -> dict[str, list[dict[str, Any]]]:
    """Two rows of each variant of verl's example ("tool", "interaction"), as its preprocessing writes them."""
    return {
        "tool": verl_data.tool_rows("train", 2, seed=GSM8K_ROWS_SEED),
        "interaction": verl_data.interaction_rows("train", 2, seed=GSM8K_ROWS_SEED),
    }


def gsm8k_submissions(row: dict[str, Any]) -> list[str]:
    """The answers the GSM8K model gives a row, in order: the first row's right at once, the second's wrong first."""
    truth = row["reward_model"]["ground_truth"]
    return [truth] if row["extra_info"]["index"] == 0 else [str(int(truth) + 1), truth]


async def _gsm8k_conversation(variant: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's conversation as verl's example runs it, its tool results and user replies from the shipped classes:
    each answer submitted to ``calc_gsm8k_reward`` then the last one written out, or each written out and graded."""
    messages = list(row["prompt"])
    truth = row["reward_model"]["ground_truth"]
    if variant == "tool":
        tool_set, created = load_tool_set(GSM8K_TOOLS_PATH), {}
        create_kwargs = {name: spec["create_kwargs"] for name, spec in row["extra_info"]["tools_kwargs"].items()}
        for answer in gsm8k_submissions(row):
            turn = call("calc_gsm8k_reward", {"answer": answer})
            result = await tool_set.call(parse_hermes(turn)[1][0], "gsm8k", created, create_kwargs)
            messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": result.text}]
        await tool_set.finish("gsm8k", created)
        return messages + [{"role": "assistant", "content": f"#### {truth}"}]
    interaction = load_interactions(GSM8K_INTERACTIONS_PATH)["gsm8k"]
    await interaction.start_interaction("gsm8k", **row["extra_info"]["interaction_kwargs"])
    for answer in gsm8k_submissions(row):
        messages.append({"role": "assistant", "content": f"#### {answer}"})
        done, reply, _, _ = await interaction.generate_response("gsm8k", messages)
        if not done:  # the conversation ends at the right answer: nothing follows it to learn
            messages.append({"role": "user", "content": reply})
    await interaction.finalize_interaction("gsm8k")
    return messages


def build_gsm8k_model() -> str:
    """A model that plays verl's GSM8K example on ``gsm8k_example_rows()`` (``gsm8k_submissions`` gives its answers)."""
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    schemas = load_tool_set(GSM8K_TOOLS_PATH).schemas
    texts = [
        tokenizer.apply_chat_template(
            asyncio.run(_gsm8k_conversation(variant, row)), tools=schemas if variant == "tool" else None, tokenize=False
        )
        for variant, rows in gsm8k_example_rows().items()
        for row in rows
    ]
    key = hashlib.sha256(json.dumps([base, texts, STOP_MARGIN]).encode()).hexdigest()[:16]
    directory = str(cache_root() / "models" / f"gsm8k-{key}")
    return finetune(base, texts, directory, steps=400, stop_margin=STOP_MARGIN, desc="GSM8K test model")


def build_coin_model() -> str:
    """A model that answers "question N" with "yes" or "no", each about half the time when sampled.

    A random tiny model spreads its mass over the whole vocabulary, so no reward it can reach moves in a
    few steps; this one puts its mass on two answers, and rewarding one of them is learned in a step or two.
    """
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}], tokenize=False
        )
        for i in range(24)
        for answer in ("yes", "no")
    ]
    key = hashlib.sha256(json.dumps([base, texts]).encode()).hexdigest()[:16]
    return finetune(base, texts, str(cache_root() / "models" / f"coin-{key}"), steps=60, desc='"yes or no" test model')


def says_yes(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any) -> float:
    """The coin model's reward (a verl-style reward function): 1 for an answer that starts with "yes"."""
    return float(solution_str.strip().startswith("yes"))


BUILDERS = {
    "tiny": tiny_model_path,
    "scripted": build_scripted_model,
    "ok": build_ok_model,
    "coin": build_coin_model,
    "vlm": tiny_vlm_path,
    "corridor": corridor_warm_start,
    "reward_model": tiny_reward_model_path,
    "gsm8k": build_gsm8k_model,
}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        BUILDERS[name]()
