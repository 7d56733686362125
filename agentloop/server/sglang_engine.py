"""Engine ``sglang``: SGLang through its native HTTP API, token ids only (``--skip-tokenizer-init``).

Why a ``python -m sglang.launch_server`` process the server actor starts, rather than the in-process
``sglang.Engine``: SGLang owns its CUDA context, NCCL groups and scheduler subprocesses, and a crash
or OOM there must not take the Ray actor (and the trainer's view of it) down with it; the HTTP
contract is also exactly what the attach mode speaks, so one client serves both. Attach mode
(``rollout.sglang.urls``) drives already-running SGLang servers of a disaggregated fleet.

Tested SGLang: 0.5.21–0.5.23 (request shapes validated against the wheel's ``api/v1/api_types.py``).
Unknown sampling keys are rejected by SGLang >= 0.5.22, so only valid ones are sent.

Each call gets its own ``rid`` (``<session>#<n>``): SGLang rejects a rid that is already in flight,
and one session may have several calls in flight; ``abort(session)`` aborts every rid of the session.
Calls share one HTTP connection pool per event loop (an ``aiohttp`` session is bound to the loop
that opened it), so a turn does not pay for a new connection.

Request bodies and answers are in ``sglang_requests`` (images included).

A collective push (``rollout.weight_sync=collective``) reaches SGLang through its own distributed update: the server
joins the push's group (``/init_weights_update_group``), receives each bucket's tensors
(``/update_weights_from_distributed``, one broadcast per tensor) and leaves the group
(``/destroy_weights_update_group``), with generation paused; every call bounded by ``weight_sync_timeout_s``.

LoRA runs push adapters: each is written in PEFT's format to ``rollout.sglang.weights_dir`` and loaded through
``/load_lora_adapter`` under one fixed name, the previous one unloaded first (``/unload_lora_adapter``), with
generation paused; every request names it (``lora_path``). The fixed name matters: a request that reaches SGLang
while generation is paused waits there and looks its adapter up by name only when generation continues, so it
finds the new adapter, never an unloaded one. Several adapters (``actor_rollout_ref.model.lora_adapters``) get a
fixed name each, ``agentloop-policy-<name>``, and each request names its sample's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Mapping

import torch
from transformers import AutoConfig, GenerationConfig

from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput
from agentloop.server.sampling import finish_reason_of, id_list, validate_sampling_params
from agentloop.server.adapters import PackedAdapter, served_adapter
from agentloop.server.collective import Manifest, WeightGroup, bucket_plan
from agentloop.settings.adapters import DEFAULT_ADAPTER
from agentloop.server.engine import EngineAsleep
from agentloop.server.launched import InFlightCalls, JSONClient, ServerProcess
from agentloop.settings import ServerSettings
from agentloop.server.sglang_requests import (
    build_generate_request,
    check_prompt_tokens,
    init_weights_group_request,
    load_adapter_request,
    parse_generate_response,
    unload_adapter_request,
    weights_from_distributed_request,
)

ADAPTER_NAME = "agentloop-policy"  # what each pushed LoRA adapter is loaded as (see the module's docstring)


def launch_args(settings: ServerSettings, rank: int) -> list[str]:
    """``sglang.launch_server`` flags for the server of ``rank``: ``rollout.sglang``'s settings (verl's
    ``tensor_model_parallel_size`` and ``gpu_memory_utilization`` reach them by interpolation), then each
    ``rollout.engine_kwargs.sglang`` entry as a flag (``attention_backend: triton`` -> ``--attention-backend
    triton``; true -> the bare flag, false or null -> left out), then ``sglang.extra_args``."""
    sglang = settings.sglang
    engine_flags: list[str] = []
    for key, value in settings.engine_kwargs.get("sglang", {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            engine_flags.append(flag)
        elif value is not None and value is not False:
            engine_flags += [flag, str(value)]
    return [
        "--mem-fraction-static",
        str(sglang.mem_fraction_static),
        "--tp-size",
        str(sglang.tensor_parallel_size),
        "--dtype",
        settings.dtype,
        "--random-seed",
        str(settings.seed + rank),
        *(["--enable-memory-saver"] if sglang.enable_memory_saver else []),
        *_lora_flags(settings),
        *engine_flags,
        *sglang.extra_args,
    ]


def _lora_flags(settings: ServerSettings) -> list[str]:
    """A LoRA run's server: adapters up to the policy's rank on its target modules (SGLang preallocates their
    buffers at launch; ``all``: every module it can adapt), and two adapters per batch: the pushed one and the base
    model, which SGLang's own health check samples."""
    if not settings.lora_rank:
        return []
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(settings.lora_rank),
        "--lora-target-modules",
        *settings.lora_target_modules,
        "--max-loras-per-batch",
        str(settings.lora_adapters + 1),
    ]


class SGLangEngine:
    """Async client of one SGLang server (launched here, or attached by URL)."""

    def __init__(
        self,
        model_path: str,
        *,
        url: str | None = None,
        api_key: str | None = None,
        launch_args: Iterable[str] = (),
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        port: int = 30000,
        tensor_parallel_size: int = 1,
        weights_dir: str | None = None,
    ) -> None:
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.weights_dir = weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        # once LoRA adapters were pushed, every request names one: one that fails to load fails requests loudly
        # rather than letting the base model answer them. The pushed name -> its fixed name in SGLang; the first
        # serves requests that name none
        self._adapter_names: dict[str, str] = {}
        self._adapter_dirs: dict[str, Path] = {}  # each loaded adapter's directory, removed when another replaces it
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.calls = InFlightCalls()  # each call's rid: ``<session>#<n>``
        self._sleeping = False
        self.http_url = url.rstrip("/") if url else f"http://127.0.0.1:{port}"
        self.server = ServerProcess("SGLang", self.http_url, headers)
        self.client = JSONClient("SGLang", self.http_url, headers, request_timeout_s)
        if not url:
            self.server.launch(self._command(port, list(launch_args)), os.environ)
        self.server.wait_until_healthy("/health_generate", startup_timeout_s)

    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> SGLangEngine:
        """Launch SGLang for this rank from ``rollout.sglang`` (port + rank), or attach to ``urls[rank]``."""
        return cls(
            settings.model_path,
            url=settings.attached_url("sglang", rank),
            api_key=settings.sglang.api_key,
            launch_args=launch_args(settings, rank),
            startup_timeout_s=settings.startup_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            port=settings.sglang.port + rank,
            tensor_parallel_size=settings.sglang.tensor_parallel_size,
            weights_dir=settings.sglang.weights_dir,
        )

    # ------------------------------------------------------------------ process

    def _command(self, port: int, launch_args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            *launch_args,
        ]

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines)

    async def shutdown(self) -> None:
        """Close the connection pool and stop a launched server (an attached one keeps running)."""
        await self.client.close()
        self.server.terminate()
        for directory in self._adapter_dirs.values():
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ calls

    async def _post(self, path: str, body: dict[str, Any], accept: tuple[int, ...] = (200,)) -> Any:
        return await self.client.post(path, body, accept)

    @functools.cached_property
    def image_pad_id(self) -> int:
        """The model's image pad token id, from its config (read once, on the first request with images)."""
        try:
            pad_id = getattr(AutoConfig.from_pretrained(self.model_path), "image_token_id", None)
        except Exception as error:
            raise ValueError(
                f"a request has images, but the model config at {self.model_path!r} cannot be read: {error}"
            ) from error
        if pad_id is None:
            raise ValueError(
                f"a request has images, but the model at {self.model_path!r} has no image_token_id in its config "
                "(a text-only model; actor_rollout_ref.model.path must be the vision-language checkpoint SGLang serves)"
            )
        return int(pad_id)

    @functools.cached_property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids (its generation config, else its config); none if neither is readable
        here (a server attached by URL may serve a path this host lacks)."""
        for load in (GenerationConfig.from_pretrained, lambda path: AutoConfig.from_pretrained(path).get_text_config()):
            try:
                eos = load(self.model_path).eos_token_id
            except (OSError, ValueError):
                continue
            if eos is not None:
                return id_list(eos)
        return []

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        images: list[ProcessedImage] | None = None,
        adapter: str | None = None,
    ) -> TokenOutput:
        """One turn; ``images`` (their pads expanded in ``prompt_ids``) go to SGLang as ``image_data``; ``adapter``:
        the pushed LoRA adapter that samples it (None: the first pushed, or only)."""
        lora_name = served_adapter(adapter, self._adapter_names)
        if self._sleeping:
            raise EngineAsleep("engine is asleep: call wake_up() before generate()")
        with self.calls.call(request_id) as rid:
            request = build_generate_request(
                prompt_ids,
                sampling_params,
                rid,
                images,
                image_pad_id=self.image_pad_id if images else None,
                lora_name=lora_name,
            )
            body = await self._post("/generate", request)
            if images:
                check_prompt_tokens(body, len(prompt_ids), images, self.model_path)
            output = parse_generate_response(body)
            if output.finish_reason == "abort":
                # SGLang appends the token sampled in the step that aborts a request before it checks stop tokens
                # and length; interrupted by new weights otherwise, the router continues it
                params = validate_sampling_params(sampling_params)
                stop_ids = list(params["stop_token_ids"] or []) + ([] if params["ignore_eos"] else self.eos_token_ids)
                cut = "interrupted" if self.calls.interrupted(rid) else "abort"
                output.finish_reason = finish_reason_of(output.token_ids, stop_ids, int(params["max_new_tokens"]), cut)
            return output

    async def abort(self, request_id: str) -> int:
        rids = self.calls.of(request_id)
        # 404: the request finished meanwhile (agentloop's HTTP front says so; SGLang answers 200)
        await asyncio.gather(*(self._post("/abort_request", {"rid": rid}, accept=(200, 404)) for rid in rids))
        return len(rids)

    @property
    def num_in_flight(self) -> int:
        return len(self.calls)

    # ------------------------------------------------------------------ weights and memory

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """In-place update between ``begin_weight_update`` and ``end_weight_update``, then flush the cache, with
        generation paused: requests in flight end ``interrupted`` with their tokens so far.

        Tensors travel with SGLang's own serializer as CUDA IPC handles: they are copied to this
        actor's GPU (the one its SGLang server uses) first, and each tensor-parallel rank gets the same
        handles. Needs the full ``sglang`` install and a GPU; elsewhere use ``update_weights_from_disk``.
        """
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as error:
            raise RuntimeError(
                "update_weights_from_tensor needs the full sglang package on this host; "
                "use update_weights_from_disk(path) otherwise"
            ) from error
        if not torch.cuda.is_available():
            raise RuntimeError("update_weights_from_tensor shares CUDA memory; this actor sees no GPU")
        on_gpu = [(name, tensor.detach().to("cuda", non_blocking=True)) for name, tensor in named_tensors.items()]
        torch.cuda.synchronize()
        payload = MultiprocessingSerializer.serialize(on_gpu, output_str=True)
        body = {"serialized_named_tensors": [payload] * self.tensor_parallel_size, "flush_cache": False}
        await self._update_paused("/update_weights_from_tensor", body)
        return len(named_tensors)

    async def update_adapter(self, adapter: PackedAdapter) -> int:
        """Serve the base model with ``adapter`` under ``ADAPTER_NAME`` (``update_adapters``)."""
        return await self._load_adapters({ADAPTER_NAME: adapter}, {DEFAULT_ADAPTER: ADAPTER_NAME})

    async def update_adapters(self, adapters: Mapping[str, PackedAdapter]) -> int:
        """Serve the base model with each of several adapters side by side, each under its fixed name
        (``ADAPTER_NAME-<name>``); requests name theirs (``generate``'s ``adapter``)."""
        names = {name: f"{ADAPTER_NAME}-{name}" for name in adapters}
        return await self._load_adapters({names[name]: adapter for name, adapter in adapters.items()}, names)

    async def _load_adapters(self, adapters: dict[str, PackedAdapter], names: dict[str, str]) -> int:
        """Write each adapter in PEFT's format to ``weights_dir`` and, with generation paused (requests in flight end
        ``interrupted``), unload the previous one of its fixed name and load it; then flush the cache. The server
        must be launched for LoRA (``ServerSettings.lora_rank``: ``--enable-lora`` and its shapes)."""
        directories = {}
        for served, adapter in adapters.items():
            directories[served] = Path(self.weights_dir) / f"agentloop-lora-{uuid.uuid4().hex[:12]}"
            await asyncio.to_thread(adapter.save, directories[served])
        previous, self._adapter_names = dict(self._adapter_dirs), names
        try:
            async with self._generation_paused():
                for served, directory in directories.items():
                    # before this engine's first push the name is unknown (SGLang answers 400), unless an attached
                    # server still serves an earlier run's adapter under it
                    first = (200, 400) if served not in previous else (200,)
                    await self._post("/unload_lora_adapter", unload_adapter_request(served), accept=first)
                    await self._post("/load_lora_adapter", load_adapter_request(served, str(directory)))
                    self._adapter_dirs[served] = directory
                await self.flush_cache()
        finally:  # the directories no adapter is served from: the previous ones, or these if they failed to load
            for stale in {*previous.values(), *directories.values()} - set(self._adapter_dirs.values()):
                shutil.rmtree(stale, ignore_errors=True)
        return sum(len(adapter.scalings) for adapter in adapters.values())

    async def update_weights_over_group(
        self, group: WeightGroup, rank: int, manifest: Manifest, version: int | None = None
    ) -> int:
        """Receive a collective push: the SGLang server joins ``group`` as server ``rank``'s members and takes each
        bucket of ``manifest`` tensor by tensor as the source broadcasts it, between begin/end with generation paused
        (as ``update_weights``), then leaves the group. Every call is bounded by the group's timeout."""
        world, member = group.world_size, group.member(rank)
        init = init_weights_group_request(group.address, group.port, member, world, group.name, group.backend)
        async with self._weights_paused():
            await self._within(group, "/init_weights_update_group", init)
            try:
                for _, slots in bucket_plan(manifest, group.bucket_bytes):
                    entries = [(slot.name, slot.dtype, slot.shape) for slot in slots]
                    body = weights_from_distributed_request(entries, group.name, version)
                    await self._within(group, "/update_weights_from_distributed", body)
            finally:  # a group that failed to form is unknown to SGLang: it answers 400
                await self._post("/destroy_weights_update_group", {"group_name": group.name}, accept=(200, 400))
        return len(manifest)

    async def _within(self, group: WeightGroup, route: str, body: dict[str, Any]) -> Any:
        """``route`` within the group's timeout (SGLang's own wait on the group is torch's default, many minutes)."""
        try:
            return await asyncio.wait_for(self._post(route, body), group.timeout_s + 5)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"SGLang at {self.http_url}: {route} did not answer within {group.section}.weight_sync_timeout_s="
                f"{group.timeout_s:g}s (+5): the server cannot reach the group's store at {group.address}:{group.port} "
                f"({group.section}.weight_sync_master_addr / weight_sync_master_port), or a member is missing"
            ) from None

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load a checkpoint directory the server can read, between begin/end, then flush the cache (requests in
        flight end ``interrupted``, as with ``update_weights``)."""
        await self._update_paused("/update_weights_from_disk", {"model_path": model_path})

    async def _update_paused(self, route: str, body: dict[str, Any]) -> None:
        async with self._weights_paused():
            await self._post(route, body)

    @contextlib.asynccontextmanager
    async def _weights_paused(self) -> AsyncIterator[None]:
        """Between ``/begin_weight_update`` and ``/end_weight_update`` with generation paused, then the prefix cache
        flushed."""
        async with self._generation_paused():
            await self._post("/begin_weight_update", {})
            try:
                yield
            finally:
                await self._post("/end_weight_update", {})
            await self.flush_cache()

    @contextlib.asynccontextmanager
    async def _generation_paused(self) -> AsyncIterator[None]:
        """SGLang's ``/pause_generation`` in ``abort`` mode around a weight update: the requests in flight come
        back at once with the tokens they have (``interrupted``: the router continues them under the new
        weights) and new ones wait in SGLang until ``/continue_generation``."""
        with self.calls.paused():
            try:
                await self._post("/pause_generation", {"mode": "abort"})
                yield
            finally:
                await self._post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    async def sleep(self, tags: list[str] | None = None) -> None:
        """Release GPU memory (``kv_cache`` by default; add ``weights`` to drop those too)."""
        await self._post("/release_memory_occupation", {"tags": tags or ["kv_cache"]})
        self._sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", {"tags": tags or ["kv_cache"]})
        self._sleeping = False

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping
