"""SGLang's native routes over a rollout server: token-in/token-out ``/generate`` (``input_ids``,
``sampling_params``, ``rid``, ``return_logprob`` → ``output_ids``, ``meta_info``), abort, and the weight,
cache and memory controls, so SGLang clients (our ``sglang`` backend included) can drive it.

Images come as SGLang takes them: ``image_data`` (one item per image, in order) and ONE image pad per
image in ``input_ids``. The server runs the model's processor and widens each pad to the image's token
count before the engine sees the ids, so ``meta_info.prompt_tokens`` is the expanded length, as SGLang's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator, Literal

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from agentloop.images import ProcessedImage, expand_image_pads, load_image, process_images
from agentloop.policy_versions import VersionRuns
from agentloop.protocol import TokenOutput
from agentloop.server.adapters import PackedAdapter
from agentloop.server.http.distributed import add_distributed_weight_routes
from agentloop.server.sampling import SAMPLING_DEFAULTS
from agentloop.server.weights import PackedWeights

# SGLang sampling keys accepted here; the text-only ones have no effect on token ids.
TEXT_ONLY_KEYS = {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"}
SGLANG_TOP_K_DISABLED = 1 << 30


class GenerateBody(BaseModel):
    """SGLang's ``/generate`` request, single-prompt form."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field fails loudly instead of sampling with defaults
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    rid: str | None = None
    return_logprob: bool = False
    stream: bool = False
    # one item per image pad in the prompt, in order: a data URI, bare base64, a path on the server, or {"url": ...}
    image_data: str | dict[str, Any] | list[str | dict[str, Any]] | None = None
    lora_path: str | None = None  # the name of a loaded LoRA adapter (``/load_lora_adapter``), as SGLang's


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str = ""
    abort_all: bool = False  # SGLang's: every request in flight


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # abort: requests in flight end now, with the tokens they have; in_place and retract keep them, and the next
    # weight update interrupts them with the tokens they have
    mode: Literal["abort", "retract", "in_place"] = "abort"


class WeightsFromDiskBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's load_format and flush_cache change nothing here
    model_path: str


class LoadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str  # a PEFT adapter directory on the server
    pinned: bool = False  # SGLang's: kept in GPU memory; here the one adapter always is


class UnloadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


@dataclasses.dataclass
class ServedAdapter:
    """The LoRA adapter the server serves, by the name ``/load_lora_adapter`` gave it (None: the base model).

    The engine merges one adapter into its weights, so unlike SGLang, which serves any loaded adapter and the base
    model side by side, a request is served only when it names what the weights are now: the adapter while one is
    loaded, else none."""

    name: str | None = None
    loaded: PackedAdapter | None = None

    def check(self, lora_path: str | None) -> None:
        if lora_path == self.name:
            return
        if lora_path is None:
            raise ValueError(
                f"the LoRA adapter {self.name!r} is merged into this server's weights: name it in lora_path "
                "(this server serves the base model only while no adapter is loaded)"
            )
        raise ValueError(f"the LoRA adapter {lora_path!r} is not loaded; loaded: {[self.name] if self.name else []}")


def sglang_to_engine_params(params: dict[str, Any]) -> dict[str, Any]:
    """Map SGLang sampling params onto the engine's, rejecting keys neither knows."""
    unknown = sorted(set(params) - set(SAMPLING_DEFAULTS) - TEXT_ONLY_KEYS)
    if unknown:
        raise ValueError(
            f"unsupported sampling_params {unknown}; supported: {sorted(set(SAMPLING_DEFAULTS) | TEXT_ONLY_KEYS)}"
        )
    mapped = {key: value for key, value in params.items() if key in SAMPLING_DEFAULTS}
    # SGLang clients send 1 << 30 for "no top-k"; smaller values pass through, the engine clamps them to its vocabulary
    if isinstance(mapped.get("top_k"), int) and mapped["top_k"] >= SGLANG_TOP_K_DISABLED:
        mapped["top_k"] = -1
    return mapped


class ServerImages:
    """The HTTP front's side of image inputs: the model's processor (None for a text-only model) and its pad id."""

    def __init__(self, processor: Any | None, tokenizer: PreTrainedTokenizerBase) -> None:
        self.processor = processor
        self.pad_id = int(tokenizer.convert_tokens_to_ids(processor.image_token)) if processor is not None else None

    async def process(self, images: list[Any], where: str) -> list[ProcessedImage]:
        """Read and process ``images`` (PIL images or ``image_data`` items) off the event loop, which serves every request."""
        if not images:
            return []
        return await asyncio.to_thread(self._process, images, where)

    def _process(self, images: list[Any], where: str) -> list[ProcessedImage]:
        loaded = [
            image
            if isinstance(image, Image.Image)
            else load_image(image_source(image, f"{where} {index}"), f"{where} {index}")
            for index, image in enumerate(images)
        ]
        try:
            return process_images(self.processor, loaded, where)
        except ValueError:
            raise
        except Exception as error:  # the image processor's own refusals (sizes, modes) are the client's input too
            raise ValueError(
                f"{where}: the image processor cannot process these images: {type(error).__name__}: {error}"
            ) from error

    def expand(self, ids: list[int], images: list[ProcessedImage], where: str) -> list[int]:
        """``ids`` with each image's single pad widened to its tokens (unchanged for a text-only model)."""
        if self.pad_id is None:
            return ids  # no images reach here: ``process`` refused them
        return expand_image_pads(ids, images, self.pad_id, where)


def image_source(value: str | dict[str, Any], where: str) -> Any:
    """What ``load_image`` reads for one ``image_data`` item; SGLang also takes bare base64, which it does not."""
    if isinstance(value, dict):
        if set(value) != {"url"} or not isinstance(value["url"], str):
            # per-image options (min_pixels, max_pixels, ...) would change the image's token count: refused, not ignored
            raise ValueError(
                f"{where}: only {{'url': ...}} is supported in an image_data object, got keys {sorted(value)}"
            )
        value = value["url"]
    if value.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: this server does not fetch URLs; send the image as a data URI, base64 or a path on the server"
        )
    if value.startswith(("data:", "file://")):
        return value
    try:
        if Path(value).is_file():
            return value
    except OSError:  # a long base64 string is no valid path
        pass
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: neither a data URI, base64 nor a file on the server: {value[:60]!r}") from None


def image_data_items(
    image_data: str | dict[str, Any] | list[str | dict[str, Any]] | None,
) -> list[str | dict[str, Any]]:
    """``image_data`` as a list (SGLang takes one item bare)."""
    if image_data is None:
        return []
    return list(image_data) if isinstance(image_data, list) else [image_data]


def finish_reason_json(output: TokenOutput) -> dict[str, Any]:
    """SGLang's ``meta_info.finish_reason`` for an engine output."""
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": output.token_ids[-1] if output.token_ids else None}
    if output.finish_reason == "length":
        return {"type": "length", "length": len(output.token_ids)}
    return {"type": "abort", "message": "aborted"}


def weight_versions_json(runs: VersionRuns, version: int | None) -> dict[str, Any]:
    """SGLang's report of the weights that sampled a reply (``meta_info`` of ``/generate``, ``metadata`` of a
    chat completion): ``weight_versions``, one ``{version, start, end}`` span per run of tokens from one
    version (``runs``, as ``generate_continued`` returns them), and
    ``weight_version``, the last; versions as strings, as SGLang's."""
    spans: list[dict[str, Any]] = []
    for run_version, count in runs.runs:
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": str(run_version), "start": start, "end": start + count})
    spans = spans or [{"version": str(version), "start": 0, "end": 0}]  # no tokens: the weights loaded
    return {"weight_version": spans[-1]["version"], "weight_versions": spans}


class Admission:
    """The HTTP requests in the engine (by rid; a client may reuse one) and the gate ``/pause_generation`` closes
    for every generating route, as SGLang's pause holds them all."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.in_flight: Counter[str] = Counter()

    @contextlib.asynccontextmanager
    async def admitted(self, rid: str) -> AsyncIterator[None]:
        """Wait while paused, then count ``rid`` in flight for the block."""
        await self.open.wait()
        self.in_flight[rid] += 1
        try:
            yield
        finally:
            self.in_flight[rid] -= 1
            if not self.in_flight[rid]:
                del self.in_flight[rid]

    async def abort_all(self, server: Any) -> int:
        """Abort every request in flight on ``server``; how many engine calls ended."""
        return sum(await asyncio.gather(*(server.abort(rid) for rid in list(self.in_flight))))


def native_routes(
    server: Any,
    tokenizer: PreTrainedTokenizerBase,
    images: ServerImages | None = None,
    admission: Admission | None = None,
) -> APIRouter:
    """Every SGLang-native route but ``/health``, which the app serves without the API key. ``images``: how
    ``image_data`` is read (default: refused, a text-only model); ``admission``: the pause gate shared with the
    chat route."""
    router = APIRouter()
    images = images or ServerImages(None, tokenizer)
    admission = admission or Admission()
    adapter = ServedAdapter()
    add_generation_routes(router, server, tokenizer, images, admission, adapter)
    add_admission_routes(router, server, admission)
    add_weight_and_memory_routes(router, server)
    add_adapter_routes(router, server, adapter)
    add_distributed_weight_routes(router, server)
    return router


def add_generation_routes(
    router: APIRouter,
    server: Any,
    tokenizer: PreTrainedTokenizerBase,
    images: ServerImages,
    admission: Admission,
    adapter: ServedAdapter,
) -> None:
    """``/health_generate`` and token-in/token-out ``/generate``, admitted through ``admission``; a ``/generate``
    names the served LoRA ``adapter`` (checked once admitted, as SGLang looks adapters up after a pause)."""

    @router.get("/health_generate")
    async def health_generate() -> dict[str, str]:
        await server.generate([tokenizer.eos_token_id or 0], {"max_new_tokens": 1}, f"health-{uuid.uuid4()}")
        return {"status": "ok"}

    @router.post("/generate")
    async def generate(body: GenerateBody) -> dict[str, Any]:
        if body.stream:
            raise ValueError("stream=true is not supported by this server; send stream=false")
        if body.input_ids is None and body.text is None:
            raise ValueError("send input_ids (token ids) or text")
        ids = body.input_ids if body.input_ids is not None else tokenizer.encode(body.text, add_special_tokens=False)
        params = sglang_to_engine_params(body.sampling_params)
        processed = await images.process(image_data_items(body.image_data), "image_data")
        ids = images.expand(ids, processed, "input_ids (one image pad per image_data item)")
        rid = body.rid or uuid.uuid4().hex
        async with admission.admitted(rid):
            adapter.check(body.lora_path)
            start = time.perf_counter()
            output = await server.generate(ids, params, rid, images=processed or None)
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": len(ids),
            "completion_tokens": len(output.token_ids),
            "finish_reason": finish_reason_json(output),
            "cached_tokens": output.cached_tokens,
            "e2e_latency": time.perf_counter() - start,
            **weight_versions_json(
                VersionRuns([[output.policy_version, len(output.token_ids)]]), output.policy_version
            ),
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [[lp, token, None] for lp, token in zip(output.log_probs, output.token_ids)]
        return {
            "text": tokenizer.decode(output.token_ids, skip_special_tokens=True),
            "output_ids": output.token_ids,
            "meta_info": meta,
        }


def add_admission_routes(router: APIRouter, server: Any, admission: Admission) -> None:
    """``/abort_request``, and ``/pause_generation`` and ``/continue_generation``, which close and open the gate."""

    @router.post("/abort_request")
    async def abort_request(body: AbortBody) -> JSONResponse:
        if body.abort_all:
            return JSONResponse({"aborted": await admission.abort_all(server)})
        if not body.rid:
            raise ValueError("send the rid of the request to abort, or abort_all: true")
        aborted = await server.abort(body.rid)
        if not aborted:  # SGLang answers 200 here; a client that aborts a finished request learns so
            message = f"no request with rid {body.rid!r} is in flight (finished, already aborted, or never sent)"
            return JSONResponse(status_code=404, content={"aborted": 0, "error": {"message": message, "code": 404}})
        return JSONResponse({"aborted": aborted})

    @router.post("/pause_generation")
    async def pause_generation(body: PauseBody) -> dict[str, str]:
        admission.open.clear()
        if body.mode == "abort":
            await admission.abort_all(server)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @router.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        admission.open.set()
        return {"message": "Generation continued successfully.", "status": "ok"}


def add_weight_and_memory_routes(router: APIRouter, server: Any) -> None:
    """Weight, cache and memory control in SGLang's shapes, so the sglang backend's client can drive this server."""

    @router.post("/begin_weight_update")
    @router.post("/end_weight_update")
    async def weight_update_session() -> dict[str, Any]:
        return {"success": True, "message": "weight updates here are atomic; no session to open or close"}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: WeightsFromDiskBody) -> dict[str, Any]:
        if not body.model_path or not Path(body.model_path).is_dir():
            raise ValueError(f"model_path {body.model_path!r} is not a directory on the server")
        try:
            await server.update_weights_from_disk(body.model_path)
        except (FileNotFoundError, KeyError) as error:  # no weights there, or another model's: the model is unchanged
            raise ValueError(f"cannot load weights from {body.model_path!r}: {error}") from error
        return {"success": True, "message": f"loaded {body.model_path}", "num_paused_requests": 0}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        await server.flush_cache()
        return {"success": True}

    @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation() -> dict[str, Any]:
        await server.sleep()
        return {"success": True}

    @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation() -> dict[str, Any]:
        await server.wake_up()
        return {"success": True}


def add_adapter_routes(router: APIRouter, server: Any, adapter: ServedAdapter) -> None:
    """SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter`` over the engine's adapter pushes: one adapter at
    a time, merged into the weights (``ServedAdapter``)."""

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterBody) -> dict[str, Any]:
        if adapter.name is not None:
            raise ValueError(
                f"the LoRA adapter {adapter.name!r} is loaded: this server serves one at a time; unload it first"
            )
        if not (Path(body.lora_path) / "adapter_config.json").is_file():
            raise ValueError(f"lora_path {body.lora_path!r} is not a PEFT adapter directory on the server")
        loaded = await asyncio.to_thread(PackedAdapter.load, Path(body.lora_path))
        try:
            await server.update_weights(loaded)
        except KeyError as error:  # another model's adapter: the weights are unchanged
            raise ValueError(f"cannot load the LoRA adapter at {body.lora_path!r}: {error}") from error
        adapter.name, adapter.loaded = body.lora_name, loaded
        return {"success": True, "error_message": "", "loaded_adapters": {body.lora_name: body.lora_path}}

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterBody) -> dict[str, Any]:
        if adapter.name is None or body.lora_name != adapter.name:
            raise ValueError(f"the LoRA adapter {body.lora_name!r} is not loaded (SGLang answers so too)")
        # the base weights back: the adapter with zero factors merges to exactly them
        zeros = {name: torch.zeros_like(tensor) for name, tensor in adapter.loaded.weights.tensors().items()}
        await server.update_weights(dataclasses.replace(adapter.loaded, weights=PackedWeights.pack(zeros)))
        adapter.name, adapter.loaded = None, None
        return {"success": True, "error_message": "", "loaded_adapters": {}}
