"""Loading a checkpoint directory the same way everywhere: the model class, the tokenizer and, for a
vision-language model, its processor.

transformers' ``AutoProcessor`` needs torchvision for Qwen-VL processors (their video part) and, without
it, either fails or silently returns the bare tokenizer. ``load_processor`` falls back to the tokenizer
and the image processor saved in the directory (the PIL image processor needs no torchvision), joined
in ``ImageTextProcessor``; every part of agentloop that needs a processor gets it here.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer


@functools.lru_cache(maxsize=16)
def is_vision_language(path: str) -> bool:
    """Whether the checkpoint at ``path`` is a vision-language model (its config has a vision tower)."""
    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def model_class(path: str) -> type:
    """The auto class that loads the checkpoint: image-text-to-text for VLMs, causal LM otherwise."""
    return AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM


def vision_token_ids(config: Any) -> list[int]:
    """The vision special tokens of a VLM's config (image/video pads, vision start/end); [] for a text model.

    The policy never samples them (the engines suppress them and the trainer scores without them): a sampled
    pad would be taken for an image that is not there."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if getattr(config, "vision_config", None) is None:
        return []
    return [int(getattr(config, name)) for name in names if getattr(config, name, None) is not None]


def without_vision_tokens(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """``logits`` scored as the engines sample: a VLM's vision special tokens out of the softmax (-1e9, not
    -inf: exp() is 0 all the same, and entropy's 0 * logit stays 0 instead of nan). Unchanged for text."""
    hidden = vision_token_ids(config)
    if not hidden:
        return logits
    return logits.index_fill(-1, torch.tensor(hidden, device=logits.device), -1e9)


def structure(path: str) -> Any | None:
    """A vision-language model's modules without weights (meta device), for what needs only its config and
    code: M-RoPE positions (``model.model.get_rope_index``). None for a text-only model."""
    if not is_vision_language(path):
        return None
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))


def load_processor(path: str) -> Any | None:
    """The checkpoint's processor (tokenizer and image processor), or None for a text-only model."""
    if not is_vision_language(path):
        return None
    # imported here: transformers' processing and image-processing code costs ~3 CPU-seconds to import, in every
    # process that imports this module, and most (text-only servers, workers and ranks) never load a processor
    from transformers import AutoImageProcessor, AutoProcessor

    from agentloop.models.image_text_processor import ImageTextProcessor

    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception:  # e.g. no torchvision for the video processor
        processor = None
    if getattr(processor, "image_processor", None) is not None:
        return processor
    return ImageTextProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path)
    )
