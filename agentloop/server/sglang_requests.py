"""SGLang's ``/generate`` wire format: the request body for one token-in/token-out turn, and its answer.

Images travel as ``image_data`` (PNG data URIs, in order) with ONE ``<|image_pad|>`` per image in
``input_ids``: SGLang runs the model directory's processor itself and keeps caller ids verbatim only in
that form (it re-tokenizes ids that hold expanded pads). The trajectory's ids hold the expanded pads,
so each image's run is collapsed before sending, and SGLang's ``meta_info.prompt_tokens`` must come back
as the expanded length: otherwise its processor sized an image differently and the logprobs belong to
other ids, which fails the call.
"""

from __future__ import annotations

import base64
from typing import Any

from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput
from agentloop.server.sampling import validate_sampling_params

# Sent on every request: ids in and out, stop tokens kept, so the trajectory holds exactly what was sampled.
FIXED_SAMPLING = {"skip_special_tokens": False, "no_stop_trim": True}


def build_generate_request(
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    request_id: str,
    images: list[ProcessedImage] | None = None,
    *,
    image_pad_id: int | None = None,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """SGLang ``/generate`` body for one token-in/token-out turn.

    ``images``: the prompt's images in order, each filling its ``num_tokens`` pads (``image_pad_id``) in
    ``prompt_ids``; they go as PNG data URIs in ``image_data``, each run of pads collapsed to one. ``lora_name``: the
    loaded LoRA adapter that samples the turn (SGLang's ``lora_path`` takes an adapter's name); None: the base model.
    """
    params = validate_sampling_params(sampling_params)
    sampling = {
        "max_new_tokens": int(params["max_new_tokens"]),
        "temperature": float(params["temperature"]),
        "top_p": float(params["top_p"]),
        "top_k": int(params["top_k"]),
        "ignore_eos": bool(params["ignore_eos"]),
        **FIXED_SAMPLING,
    }
    if params["stop_token_ids"]:
        sampling["stop_token_ids"] = [int(token) for token in params["stop_token_ids"]]
    request = {
        "input_ids": list(prompt_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "rid": request_id,
        "stream": False,
    }
    if lora_name is not None:
        request["lora_path"] = lora_name
    if images:
        if image_pad_id is None:
            raise ValueError("a request with images needs image_pad_id (the model's <|image_pad|> token id)")
        request["input_ids"] = collapse_image_pads(prompt_ids, images, image_pad_id)
        request["image_data"] = [png_data_uri(image.png) for image in images]
    return request


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...``: a form every SGLang version reads from ``image_data``."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def load_adapter_request(lora_name: str, directory: str) -> dict[str, Any]:
    """SGLang ``/load_lora_adapter`` body: the PEFT adapter directory ``directory`` (read by the server) served as
    ``lora_name``."""
    return {"lora_name": lora_name, "lora_path": directory}


def unload_adapter_request(lora_name: str) -> dict[str, Any]:
    """SGLang ``/unload_lora_adapter`` body."""
    return {"lora_name": lora_name}


def init_weights_group_request(
    address: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str
) -> dict[str, Any]:
    """SGLang ``/init_weights_update_group`` body: join the push's group, whose store is at ``address:port``, as its
    members ``rank_offset`` and up (one per tensor-parallel rank)."""
    return {
        "master_address": address,
        "master_port": port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def weights_from_distributed_request(
    slots: list[tuple[str, str, tuple[int, ...]]], group_name: str, version: int | None
) -> dict[str, Any]:
    """SGLang ``/update_weights_from_distributed`` body: receive one broadcast per ``(name, dtype, shape)`` of a
    bucket, in order, and load them; the cache is flushed once the whole push is in (not per bucket)."""
    body: dict[str, Any] = {
        "names": [name for name, _, _ in slots],
        "dtypes": [dtype for _, dtype, _ in slots],
        "shapes": [list(shape) for _, _, shape in slots],
        "group_name": group_name,
        "flush_cache": False,
    }
    if version is not None:
        body["weight_version"] = str(version)
    return body


def collapse_image_pads(ids: list[int], images: list[ProcessedImage], pad_id: int) -> list[int]:
    """``ids`` with each image's run of ``num_tokens`` pads replaced by one pad, as SGLang takes them
    (the inverse of ``agentloop.images.expand_image_pads``)."""
    expected = [image.num_tokens for image in images]
    if ids.count(pad_id) != sum(expected):
        raise ValueError(
            f"the prompt has {ids.count(pad_id)} image pad token(s) but its {len(images)} image(s) fill {sum(expected)} "
            f"({expected}): prompt ids must hold each image's expanded pads (agentloop.images.expand_image_pads)"
        )
    collapsed: list[int] = []
    position, image = 0, 0
    while position < len(ids):
        if ids[position] != pad_id:
            collapsed.append(ids[position])
            position += 1
            continue
        run = ids[position : position + expected[image]]
        if run.count(pad_id) != len(run):
            raise ValueError(
                f"image {image} needs {expected[image]} consecutive pad tokens at position {position}, "
                "but the run there is shorter: prompt ids must hold each image's expanded pads in order"
            )
        collapsed.append(pad_id)
        position += expected[image]
        image += 1
    return collapsed


def check_prompt_tokens(body: dict[str, Any], expected: int, images: list[ProcessedImage], model_path: str) -> None:
    """Fail unless SGLang counted ``expected`` prompt tokens (the trajectory's ids, image pads expanded).

    SGLang expands each image's pad with its own processor; another count means its processor sizes
    images differently, so the returned tokens were sampled after other ids than the trajectory holds.
    """
    meta = body.get("meta_info") or {}
    if not body.get("output_ids") and (meta.get("finish_reason") or {}).get("type") == "abort":
        return  # aborted before any token: nothing was sampled, and the prompt may not have been counted yet
    counted = int(meta.get("prompt_tokens", -1))
    if counted != expected:
        raise RuntimeError(
            f"SGLang counted {counted} prompt tokens, but the trajectory's prompt has {expected} with its "
            f"{len(images)} image(s) expanded to {[image.num_tokens for image in images]} pads by the processor of "
            f"{model_path}: the server's image processor sizes images differently (another model directory or "
            "preprocessor_config.json, or other min_pixels/max_pixels); serve the same checkpoint as "
            "actor_rollout_ref.model.path"
        )


def parse_generate_response(body: dict[str, Any]) -> TokenOutput:
    """``output_ids``, ``meta_info.output_token_logprobs``, finish reason and cached tokens."""
    meta = body.get("meta_info") or {}
    ids = list(body.get("output_ids") or [])
    logprobs = [float(entry[0]) if entry[0] is not None else 0.0 for entry in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise ValueError(f"SGLang returned {len(ids)} output ids but {len(logprobs)} logprobs")
    reason = (meta.get("finish_reason") or {}).get("type", "abort")
    return TokenOutput(
        ids, logprobs, reason if reason in ("stop", "length") else "abort", int(meta.get("cached_tokens", 0))
    )
