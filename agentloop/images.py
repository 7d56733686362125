"""Images in trajectories: read from rows and observations, processed once each, laid into token ids.

Chat messages may carry images as content parts (``{"type": "image", "image": ...}``, OpenAI's
``{"type": "image_url", "image_url": {"url": ...}}``) or, in verl's convention, as ``<image>``
placeholders in text whose images come from the row's ``images`` column. ``split_images`` turns every
form into ``{"type": "image"}`` parts (what chat templates render as one image pad) plus the images in
order. ``process_images`` runs the model's image processor once over them, and ``expand_image_pads``
widens each image's single pad to the number of tokens its size needs: the ids a trajectory holds are
always the expanded ones, as the model and the trainer see them.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

PLACEHOLDER = "<image>"


@dataclass
class ProcessedImage:
    """One image as the model takes it: its patches ``[patches, patch_dim]``, its grid ``(t, h, w)`` in patches,
    how many image tokens it fills, a digest of its pixels (keys caches) and the image as PNG (for engines
    that run the processor themselves, like SGLang)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    digest: str
    png: bytes


def load_image(value: Any, where: str) -> Image.Image:
    """An RGB image from a PIL image, bytes, a file path, a ``file://`` or ``data:`` URI, or a dict with
    ``bytes``/``path`` (how parquet datasets store images) or ``url``. Errors name ``where``."""
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, dict):
            source = (
                value.get("bytes") or value.get("path") or value.get("url") or (value.get("image_url") or {}).get("url")
            )
            if source is None:
                raise ValueError(f"an image dict needs 'bytes', 'path' or 'url', got keys {sorted(value)}")
            return load_image(source, where)
        elif isinstance(value, str) and value.startswith("data:"):
            image = Image.open(io.BytesIO(base64.b64decode(value.split(",", 1)[1])))
        elif isinstance(value, (str, Path)):
            path = str(value).removeprefix("file://")
            if not Path(path).is_file():
                raise FileNotFoundError(f"no image file at {path!r}")
            image = Image.open(path)
        else:
            raise TypeError(f"expected a PIL image, bytes, a path or a data URI, got {type(value).__name__}")
        image.load()
    except Exception as error:
        raise ValueError(f"{where}: cannot read image: {error}") from error
    return image.convert("RGB")


def split_images(
    messages: list[dict[str, Any]], images: list[Any] | None, where: str
) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """The messages with every image as a bare ``{"type": "image"}`` part, and the images in order.

    Images embedded in content parts are used as they are; ``<image>`` placeholders and payload-less image
    parts take the next of ``images`` (verl's ``images`` column). Every image must have exactly one place.
    """
    supply = list(images or [])
    taken = 0
    found: list[Image.Image] = []
    normalized = []
    for position, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and PLACEHOLDER in content:
            pieces = content.split(PLACEHOLDER)
            content = [
                part
                for i, piece in enumerate(pieces)
                for part in ([{"type": "image"}] if i else []) + ([{"type": "text", "text": piece}] if piece else [])
            ]
        if not isinstance(content, list):
            normalized.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "image_url") or (isinstance(part, dict) and "image" in part and kind is None):
                payload = part.get("image") or part.get("image_url")
                if payload is None:
                    if taken >= len(supply):
                        raise ValueError(
                            f"{where}: message {position} has more image placeholders than the {len(supply)} image(s) given; "
                            "give one image per <image> (or image part)"
                        )
                    payload, taken = supply[taken], taken + 1
                found.append(load_image(payload, f"{where}, image {len(found)}"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        normalized.append({**message, "content": parts})
    if taken < len(supply):
        raise ValueError(
            f"{where}: {len(supply)} image(s) given but only {taken} placeholder(s) in the messages; "
            "put one <image> (or {'type': 'image'} part) where each image goes"
        )
    return normalized, found


def process_images(processor: Any, images: list[Image.Image], where: str) -> list[ProcessedImage]:
    """Run the image processor once over ``images``; one ``ProcessedImage`` each."""
    if not images:
        return []
    if processor is None:
        raise ValueError(
            f"{where}: has an image, but the model is text-only (actor_rollout_ref.model.path has no vision tower)"
        )
    merged = processor.image_processor(images=images, return_tensors="pt")
    merge = int(processor.image_processor.merge_size)
    result, start = [], 0
    for image, grid in zip(images, merged["image_grid_thw"].tolist()):
        patches = grid[0] * grid[1] * grid[2]
        png = io.BytesIO()
        image.save(png, format="PNG")
        result.append(
            ProcessedImage(
                pixel_values=merged["pixel_values"][start : start + patches].clone(),
                grid_thw=tuple(grid),
                num_tokens=patches // (merge * merge),
                digest=hashlib.sha256(image.tobytes() + repr(image.size).encode()).hexdigest(),
                png=png.getvalue(),
            )
        )
        start += patches
    return result


def expand_image_pads(ids: list[int], images: list[ProcessedImage], pad_id: int, where: str) -> list[int]:
    """``ids`` with its one pad per image widened to each image's ``num_tokens`` pads, in order."""
    count = ids.count(pad_id)
    if count != len(images):
        raise ValueError(f"{where}: {count} image pad(s) in the rendered text for {len(images)} image(s)")
    expanded, queue = [], iter(images)
    for token in ids:
        expanded += [pad_id] * next(queue).num_tokens if token == pad_id else [token]
    return expanded


def mrope_positions(
    model: Any, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """A vision-language model's position ids ``[4, B, L]`` for ``input_ids`` with these images: row 0 the plain
    positions (0 on padding), rows 1-3 the temporal, height and width positions of its ``get_rope_index``."""
    image_tokens = (input_ids == model.config.image_token_id).int()
    mrope, _ = model.model.get_rope_index(input_ids, image_tokens, image_grid_thw, attention_mask=attention_mask)
    if attention_mask is None:
        plain = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
    else:
        plain = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    return torch.cat([plain.unsqueeze(0), mrope])


def image_inputs(images: list[ProcessedImage]) -> dict[str, torch.Tensor]:
    """The model's ``pixel_values`` and ``image_grid_thw`` for these images, concatenated in order."""
    return {
        "pixel_values": torch.cat([image.pixel_values for image in images]),
        "image_grid_thw": torch.tensor([image.grid_thw for image in images], dtype=torch.long),
    }
