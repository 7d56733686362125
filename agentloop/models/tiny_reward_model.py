"""The project's own tiny discriminative reward model: the tiny model's tokenizer and decoder under a scalar head
(``Qwen3ForSequenceClassification``, one label), random weights.

Built like the tiny model (deterministic, seconds on CPU, cached) and saved in the Hugging Face format, so it loads
with ``AutoModelForSequenceClassification`` like a real reward-model checkpoint (``reward_model.kind=discriminative``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

from agentloop.models.cache import build_once, cache_root
from agentloop.models.tiny_qwen import tiny_model_path

BUILD_VERSION = "1"
MODEL_NAME = f"tiny-qwen3-reward-model-v{BUILD_VERSION}"


def tiny_reward_model_path() -> str:
    """Return the local directory of the tiny reward model, building it on first use (safe across processes)."""
    return build_once(cache_root() / "models" / MODEL_NAME, build_tiny_reward_model)


def build_tiny_reward_model(directory: Path, seed: int = 0) -> None:
    """The tiny model's tokenizer and config with one output label, randomly initialised (deterministic for a seed)."""
    base = tiny_model_path()
    config = Qwen3Config.from_pretrained(base, num_labels=1)
    torch.manual_seed(seed)
    Qwen3ForSequenceClassification(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(base).save_pretrained(directory)
