"""A vision-language policy's forward pass on a padded micro-batch (see ``agentloop.postprocess``).

The batch keeps each sample's images dense-padded; the model wants the micro-batch's patches concatenated
in sample order with one grid row per image, and M-RoPE positions as ``[4, b, L]``. A micro-batch without
images still runs the vision tower, on a one-token dummy image whose features enter the embeddings times
zero: FSDP ranks gather the tower's shards in lock step, so a rank that skipped it would deadlock the
others (a zero term added to the loss after the language layers comes too late to keep the order).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from tensordict import TensorDict

from agentloop.models.loading import without_vision_tokens


def attended_columns(attention_mask: torch.Tensor) -> tuple[int, int]:
    """The columns ``[start, end)`` that some row attends. The rest is padding in every row: left of the prompts
    (padded to ``data.max_prompt_length``) and right of the responses (padded to ``data.max_response_length``),
    often several times a micro-batch's longest."""
    attended = attention_mask.any(0).int()
    return int(attended.argmax()), len(attended) - int(attended.flip(0).argmax())


def model_inputs(batch: TensorDict) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward for this (micro-)batch, text or vision.

    Columns that are padding in every row are dropped (``attended_columns``): positions are explicit, so no
    remaining logit changes.
    """
    start, end = attended_columns(batch["attention_mask"])
    inputs = {key: batch[key][..., start:end] for key in ("input_ids", "attention_mask", "position_ids")}
    if "image_grid_thw" not in batch.keys():
        return inputs
    inputs["position_ids"] = inputs["position_ids"].transpose(0, 1)  # [b, 4, L] -> [4, b, L]
    grids = batch["image_grid_thw"]
    patches = grids.prod(-1)  # 0 on the padding rows
    if patches.sum() > 0:
        inputs["image_grid_thw"] = grids[patches > 0]
        inputs["pixel_values"] = torch.cat(
            [pixels[: int(count)] for pixels, count in zip(batch["pixel_values"], patches.sum(-1))]
        )
    return inputs


@contextlib.contextmanager
def vision_tower_in_step(model: Any, inputs: dict[str, torch.Tensor], patch_dim: int) -> Iterator[None]:
    """Inside the block, a forward of a VLM without images still runs its vision tower (see the module doc)."""
    if "pixel_values" in inputs or getattr(model.config, "vision_config", None) is None:
        yield
        return
    inner = model.model
    merge = int(model.config.vision_config.spatial_merge_size)
    param = next(inner.visual.parameters())

    def add_zero_image(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dummy = torch.zeros((merge * merge, patch_dim), dtype=param.dtype, device=kwargs["inputs_embeds"].device)
        grid = torch.tensor([[1, merge, merge]], device=dummy.device)
        features = torch.cat(inner.get_image_features(dummy, grid, return_dict=True).pooler_output)
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + 0.0 * features.mean()
        return args, kwargs

    handle = inner.language_model.register_forward_pre_hook(add_zero_image, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def forward_logits(model: Any, batch: TensorDict, last: int | None = None) -> torch.Tensor:
    """The model's logits on a padded (micro-)batch, at its ``last`` attended columns only where given (the output
    head skips the prompt: at a 151,936-token vocabulary a 450-token row's logits are 0.27 GB in float32, and their
    gradient as large); a VLM's never put mass on its vision special tokens, which the engines never sample."""
    inputs = model_inputs(batch)
    if last is not None:
        inputs["logits_to_keep"] = last
    if "pixel_values" not in batch.keys():
        return model(**inputs).logits
    with vision_tower_in_step(model, inputs, batch["pixel_values"].shape[-1]):
        logits = model(**inputs).logits
    return without_vision_tokens(logits, model.config)
