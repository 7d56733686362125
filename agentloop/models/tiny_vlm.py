"""The project's own tiny vision-language model: Qwen2-VL architecture, the tiny text model's tokenizer with
the vision special tokens, a PIL image processor (no torchvision) and a chat template that takes content lists.

Built like the text model (deterministic, seconds on CPU, cached) and saved in the Hugging Face format, so it
loads with ``AutoTokenizer``, ``AutoImageProcessor`` and ``AutoModelForImageTextToText`` like a real
Qwen2-VL checkpoint (``agentloop.models.loading`` joins tokenizer and image processor).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from agentloop.models.cache import build_once, cache_root
from agentloop.models.tiny_qwen import DECODER_SIZE, build_tokenizer

BUILD_VERSION = "1"
MODEL_NAME = f"tiny-qwen2-vl-v{BUILD_VERSION}"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE_PATH = Path(__file__).with_name("vl_chat_template.jinja")
# 28x28 pixels make one image token (14-pixel patches, merged 2x2): 4 to 16 tokens per image
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def tiny_vlm_path() -> str:
    """Return the local directory of the tiny vision-language model, building it on first use."""
    return build_once(cache_root() / "models" / MODEL_NAME, build_tiny_vlm)


def build_tiny_vlm(directory: Path, seed: int = 0) -> None:
    """Build tokenizer, image processor and randomly initialised weights into ``directory``."""
    tokenizer = build_tokenizer(random.Random(seed))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text()
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            **DECODER_SIZE,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        ),
        vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    ).save_pretrained(directory)
