"""``RolloutServer``: the Ray actor that hosts one inference engine for one data-parallel rank.

It picks the backend named by ``actor_rollout_ref.rollout.name``, sizes the process's CPU threads,
and counts what it served so the manager can report load per server.
"""

from __future__ import annotations

import inspect
import os
import socket
from typing import Any

import ray
import torch
from omegaconf import DictConfig

from agentloop.protocol import TokenOutput
from agentloop.server.weights import PackedWeights


def build_engine(config: DictConfig, rank: int) -> Any:
    """Instantiate the engine named by ``rollout.name`` for this rank."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.name == "hf":
        from agentloop.server.hf_engine import HFEngine

        return HFEngine(
            config.actor_rollout_ref.model.path,
            device=rollout.hf.device,
            dtype=rollout.dtype,
            page_size=rollout.hf.page_size,
            num_blocks=rollout.hf.num_blocks,
            max_batch_tokens=rollout.hf.max_batch_tokens,
            seed=rollout.seed + rank,
        )
    if rollout.name == "sglang":
        from agentloop.server.sglang_engine import SGLangEngine

        settings = rollout.sglang
        launch_args = [
            "--mem-fraction-static", str(settings.mem_fraction_static),
            "--tp-size", str(settings.tensor_parallel_size),
            "--dtype", rollout.dtype,
            "--random-seed", str(rollout.seed + rank),
            *(["--enable-memory-saver"] if settings.enable_memory_saver else []),
            *settings.extra_args,
        ]
        urls = list(settings.urls or [])
        if urls and len(urls) < rollout.data_parallel_size:
            raise ValueError(
                f"rollout.sglang.urls lists {len(urls)} server(s) for data_parallel_size={rollout.data_parallel_size}"
            )
        return SGLangEngine(
            config.actor_rollout_ref.model.path,
            url=urls[rank] if urls else None,
            api_key=settings.api_key,
            launch_args=launch_args,
            startup_timeout_s=rollout.server_startup_timeout_s,
            request_timeout_s=rollout.request_timeout_s,
            port=int(settings.port) + rank,
            tensor_parallel_size=int(settings.tensor_parallel_size),
        )
    raise ValueError(
        f"actor_rollout_ref.rollout.name={rollout.name!r} is not a known backend; available: ['hf', 'sglang']"
    )


async def _maybe_await(value: Any) -> Any:
    """Engines answer control calls synchronously (hf) or as coroutines (sglang's HTTP client)."""
    return await value if inspect.isawaitable(value) else value


@ray.remote
class RolloutServer:
    """One engine behind token-in/token-out ``generate`` plus weight, memory and abort controls."""

    def __init__(self, config: DictConfig, rank: int) -> None:
        cpus = int(config.actor_rollout_ref.rollout.resources_per_server.get("CPU", 1))
        torch.set_num_threads(max(1, cpus))
        self.rank = rank
        self.config = config
        self.engine = build_engine(config, rank)
        self.requests_served = 0
        self.tokens_generated = 0

    def node_info(self) -> dict[str, Any]:
        """Where this server runs: Ray node id, host name and process id."""
        return {
            "rank": self.rank,
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str
    ) -> TokenOutput:
        output = await self.engine.generate(prompt_ids, sampling_params, request_id)
        self.requests_served += 1
        self.tokens_generated += len(output.token_ids)
        return output

    async def start_http(self) -> str:
        """Serve ``/generate``, ``/v1/chat/completions`` and ``/health``; return the base URL."""
        from transformers import AutoTokenizer

        from agentloop.server.http import build_app, serve

        if hasattr(self.engine, "url"):  # an SGLang server already speaks HTTP
            return self.engine.url
        http = self.config.actor_rollout_ref.rollout.http
        tokenizer = AutoTokenizer.from_pretrained(self.config.actor_rollout_ref.model.path)
        app = build_app(
            self,
            tokenizer,
            model_name=str(self.config.actor_rollout_ref.model.path),
            tool_format=self.config.actor_rollout_ref.rollout.multi_turn.format,
            api_key=http.api_key,
        )
        self.http_server, port = await serve(app, http.host, int(http.port) + self.rank if http.port else 0)
        # a wildcard bind is reached through this node's address
        host = ray.util.get_node_ip_address() if http.host in ("0.0.0.0", "::") else http.host
        return f"http://{host}:{port}"

    async def abort(self, request_id: str) -> int:
        return await _maybe_await(self.engine.abort(request_id))

    async def update_weights(self, state_dict: dict[str, torch.Tensor] | PackedWeights) -> int:
        """Copy new weights into the engine (prefix cache flushed); returns how many tensors were updated."""
        if isinstance(state_dict, PackedWeights):
            state_dict = state_dict.tensors()
        return await _maybe_await(self.engine.update_weights(state_dict))

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load new weights from a checkpoint directory (safetensors), flushing the prefix cache."""
        await _maybe_await(self.engine.update_weights_from_disk(model_path))

    async def sleep(self) -> None:
        await _maybe_await(self.engine.sleep())

    async def wake_up(self) -> None:
        await _maybe_await(self.engine.wake_up())

    async def stats(self) -> dict[str, int]:
        return {
            "requests_served": self.requests_served,
            "tokens_generated": self.tokens_generated,
            "in_flight": self.engine.num_in_flight,
        }
