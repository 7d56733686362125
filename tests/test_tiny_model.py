"""The tiny default model: deterministic, loadable like any checkpoint, with a template that carries real hazards."""

import hashlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop.config import compose_config
from agentloop.models.tiny_qwen import build_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _digest(directory: Path) -> dict[str, str]:
    return {file.name: hashlib.sha256(file.read_bytes()).hexdigest() for file in sorted(directory.iterdir())}


def test_build_is_deterministic(tmp_path):
    build_tiny_model(tmp_path / "a")
    build_tiny_model(tmp_path / "b")
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_default_model_path_loads_with_auto_classes(model_path):
    config = compose_config()
    assert config.actor_rollout_ref.model.path == model_path
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer("The answer is 42.", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "The answer is 42."
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_chat_template_hazards(model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": "<think>\nadd them\n</think>\n\nLet me compute.",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
            ],
        },
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "<think>\nit is 5\n</think>\n\nThe answer is 5."},
        {"role": "user", "content": "Thanks!"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    # tools preamble inside the system turn, after the system message
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "calculator"' in text.split("\n</tools>")[0]
    # hermes rendering of the assistant's call, tool message wrapped in <tool_response> in a user turn
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    # <think> stripped from assistant turns before the last user query, kept in the final prompt otherwise
    assert "<think>" not in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    # turns after the last user query (the current tool-using turn) keep their reasoning
    latest = tokenizer.apply_chat_template(messages[:5], tools=TOOLS, tokenize=False)
    assert "<think>\nadd them\n</think>" in latest and "<think>\nit is 5\n</think>" in latest
