"""A tiny model fine-tuned to replay scripted tool-calling conversations under greedy decoding.

The model is real (same architecture, same engine); only its weights were taught the scripts, so the
agent loop meets exactly the turns a test needs. Observations in the training text are produced by
the real parser and tools, so the model sees at rollout time what it saw in training.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from agentloop.models.sft import finetune
from agentloop.models.cache import cache_root
from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.tools.parsers import format_hermes as call, parse_hermes
from agentloop.tools.toolset import load_tool_set

TOOLS_YAML = """tools:
  - class_name: agentloop.tools.calculator.CalculatorTool
    config: {timeout_s: 5}
    tool_schema: {type: function, function: {name: calculator, description: Evaluate arithmetic.,
      parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}}}
  - class_name: agentloop.tools.calculator.AnswerTool
    config: {timeout_s: 5}
    tool_schema: {type: function, function: {name: submit_answer, description: Submit the answer.,
      parameters: {type: object, properties: {answer: {type: number}}, required: [answer]}}}
  - class_name: probe_tools.ExplodingTool
    config: {timeout_s: 5}
    tool_schema: {type: function, function: {name: explode, description: Always fails.}}
  - class_name: probe_tools.SleepyTool
    config: {timeout_s: 0.3, sleep_s: 5}
    tool_schema: {type: function, function: {name: sleepy, description: Too slow.}}
  - class_name: probe_tools.EchoTool
    config: {timeout_s: 5, max_concurrency: 2}
    tool_schema: {type: function, function: {name: echo, description: Repeat text.,
      parameters: {type: object, properties: {text: {type: string}, times: {type: integer}}, required: [text]}}}
"""


# script name -> the assistant turns the model must replay (tool results come from the real tools)
SCRIPTS: dict[str, list[str]] = {
    "multi": [call("calculator", {"expression": "2 + 3"}), call("submit_answer", {"answer": 5}), "The answer is 5."],
    "parallel": [call("calculator", {"expression": "1 + 1"}) + "\n" + call("calculator", {"expression": "3 * 3"}), "Done."],
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


def build_scripted_model(tools_path: str) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """Return the fine-tuned model's directory and each script's full conversation."""
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    schemas = load_tool_set(tools_path).schemas
    conversations = {name: asyncio.run(_conversation(name, tools_path)) for name in SCRIPTS}
    texts = [tokenizer.apply_chat_template(c, tools=schemas, tokenize=False) for c in conversations.values()]
    key = hashlib.sha256(json.dumps([base, texts]).encode()).hexdigest()[:16]
    path = finetune(base, texts, str(cache_root() / "models" / f"scripted-{key}"), steps=400)
    return path, conversations


def write_tools_yaml(directory: Path) -> str:
    path = directory / "tools.yaml"
    path.write_text(TOOLS_YAML)
    return str(path)


def build_ok_model() -> str:
    """A model that answers every turn with "ok": short, eos-terminated turns for env and user loops."""
    import random

    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(0)
    words = "keep going observation step try again history lots of text late reset start move left right".split()
    texts = []
    for i in range(40):
        messages = []
        for turn in range(rng.randint(1, 4)):
            content = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) + f" {rng.randint(0, 50)}"
            messages += [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    key = hashlib.sha256(json.dumps([base, texts]).encode()).hexdigest()[:16]
    return finetune(base, texts, str(cache_root() / "models" / f"ok-{key}"), steps=150)
