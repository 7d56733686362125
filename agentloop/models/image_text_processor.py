"""A Qwen-VL processor for images only, for checkpoints whose ``AutoProcessor`` needs torchvision (its video part).

A module of its own so that ``agentloop.models.loading`` imports it, and with it transformers' processing code,
only when a vision-language model needs a processor."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2VLProcessor


class ImageTextProcessor(Qwen2VLProcessor):
    """A Qwen-VL processor for images only (no video processor, so no torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> None:
        return None  # the parent insists on a video processor class
