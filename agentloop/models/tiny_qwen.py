"""The project's own tiny default model: a byte-level BPE tokenizer and a Qwen3-architecture causal LM.

Nothing can be downloaded at run time, so the default checkpoint is built here: deterministic (fixed
corpus, fixed seed), built in seconds on CPU, cached on disk, and saved in the Hugging Face format so
it loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` exactly like a real checkpoint.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from agentloop.models.cache import build_once, cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Bump when anything below changes what gets built: the cache directory is keyed by it.
BUILD_VERSION = "2"
MODEL_NAME = f"tiny-qwen3-v{BUILD_VERSION}"

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
VOCAB_SIZE = 1024
# the decoder's size, shared by the tiny vision-language model's language part
DECODER_SIZE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
# The text model's attention: as many parameters as DECODER_SIZE's 4 heads of 16 (2 key-value heads), in heads of 32,
# which vLLM's CPU attention serves (it refuses head_dim=16). Version 1 had DECODER_SIZE's heads.
TEXT_ATTENTION = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def tiny_model_path() -> str:
    """Return the local directory of the tiny model, building it on first use (safe across processes).

    A cached model costs no import of torch or transformers (the builders import them): hydra resolves
    ``ppo_trainer``'s default ``model.path`` while it merges any config that sets its own, before a job starts Ray.
    """
    return build_once(cache_root() / "models" / MODEL_NAME, build_tiny_model)


def _training_corpus(rng: random.Random) -> list[str]:
    """Text resembling what the model will see: chat markup, tool calls, arithmetic and plain words."""
    words = (
        "the a an of to in is are was be what how many much answer question tool call result number sum "
        "add subtract multiply divide calculate compute please think step first then final value equals "
        "user assistant system you your can may one more function functions query provided signatures "
        "return json object with name arguments within xml tags for each helpful expression correct wrong "
        "yes no hello world game move left right up down win lose score guess higher lower try again"
    ).split()
    template = CHAT_TEMPLATE_PATH.read_text()
    lines = [template] * 3
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        args = json.dumps({"expression": f"{a} {op} {b}"})
        lines.append(
            f"<|im_start|>user\n{sentence} {a} {op} {b}?<|im_end|>\n<|im_start|>assistant\n"
            f"<think>\n{sentence}\n</think>\n\n<tool_call>\n"
            f'{{"name": "calculator", "arguments": {args}}}\n</tool_call><|im_end|>\n'
            f"<|im_start|>user\n<tool_response>\n{eval(f'{a}{op}{b}')}\n</tool_response><|im_end|>\n"
            f"<|im_start|>assistant\nThe answer is {eval(f'{a}{op}{b}')}.<|im_end|>\n"
        )
    return lines


def build_tokenizer(rng: random.Random) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (any text encodes) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(rng), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE_PATH.read_text(),
        model_max_length=4096,
    )


def build_tiny_model(directory: Path, seed: int = 0) -> None:
    """Build tokenizer and randomly initialised weights into ``directory`` (deterministic for a seed)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    rng = random.Random(seed)
    tokenizer = build_tokenizer(rng)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        **{**DECODER_SIZE, **TEXT_ATTENTION},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
