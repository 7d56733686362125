"""The tiny model's architecture and tokenizer at larger sizes, with random weights (no hub here), built once into the
agentloop cache: what the benchmarks measure is cost, which the weights do not change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from agentloop.models.cache import build_once, cache_root
from agentloop.models.tiny_qwen import tiny_model_path


def scaled_tiny_model(name: str, dtype: torch.dtype = torch.float32, **dimensions: Any) -> str:
    """The path of model ``name``: the tiny model's config with ``dimensions`` (``hidden_size=768``, ...), saved in
    ``dtype``, and its tokenizer."""
    return build_once(cache_root() / "models" / name, lambda directory: _build(directory, dtype, dimensions))


def _build(directory: Path, dtype: torch.dtype, dimensions: dict[str, Any]) -> None:
    settings = AutoConfig.from_pretrained(tiny_model_path()).to_dict()
    del settings["layer_types"]  # derived from the depth
    settings.update(dimensions)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(directory)
