"""``RolloutServer``: the Ray actor that hosts one inference engine for one data-parallel rank.

It builds the engine its ``ServerSettings`` name (``rollout.name``, see ``engine.py``), sizes the
process's CPU threads, unpacks pushed weights and serves the HTTP front.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import traceback
from typing import Any, AsyncIterator

import ray
import torch
from ray.exceptions import RayTaskError

from agentloop.allocator import keep_freed_memory
from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput
from agentloop.server.adapters import PackedAdapter
from agentloop.server.accounting import BusyClock, node_info
from agentloop.server.collective import WeightGroup, WeightReceiver
from agentloop.server.engine import Engine, build_engine
from agentloop.server.weights import PackedWeights
from agentloop.settings import ServerSettings


@ray.remote
class RolloutServer:
    """One engine behind token-in/token-out ``generate`` plus weight, memory and abort controls."""

    def __init__(self, settings: ServerSettings, rank: int) -> None:
        torch.set_num_threads(settings.cpus)
        keep_freed_memory()  # every engine step frees and reallocates tensors of the same sizes
        self.rank = rank
        self.settings = settings
        self.engine: Engine = build_engine(settings, rank)
        # What exists now lives as long as the actor: kept out of the cyclic collector's scans, the full
        # collections transformers runs at each restart of its batching loop (a weight update with requests in
        # flight, a sleep) take milliseconds instead of a quarter second each.
        gc.freeze()
        self.http_server: Any = None
        self.policy_version = 0  # the trainer's number for the weights loaded (pushes applied)
        # Set while no weight update is under way. An engine that yields during its update (SGLang's pause and
        # HTTP calls) gets the interrupted requests back before the update ends; their continuations must wait
        # here, or they would be stamped with the old version and then sampled by the new weights.
        self._weights_settled = asyncio.Event()
        self._weights_settled.set()
        self._busy = BusyClock()

    def node_info(self) -> dict[str, Any]:
        """Where this server runs: Ray node id, host name and process id."""
        return node_info(self.rank)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        images: list[ProcessedImage] | None = None,
        adapter: str | None = None,
    ) -> TokenOutput:
        """One turn (``Engine.generate``); ``adapter``: the LoRA adapter, of those pushed, that samples it (None: the
        first pushed, or only)."""
        # a weight update interrupts the requests in flight: the tokens returned were sampled by the weights
        # loaded when the request started
        await self._weights_settled.wait()
        version = self.policy_version
        extra: dict[str, Any] = {"images": images} if images else {}  # engines written for text only keep working
        if adapter is not None:  # as do engines that serve one adapter
            extra["adapter"] = adapter
        with self._busy.request():
            output = await self.engine.generate(prompt_ids, sampling_params, request_id, **extra)
        output.policy_version = version
        return output

    async def generate_many(
        self, requests: list[tuple[Any, ...]]
    ) -> AsyncIterator[list[tuple[int, TokenOutput | BaseException]]]:
        """``generate(*request)`` for each request, in one Ray call (the router sends a burst of turns this way):
        yields ``(position, output)`` pairs, or the error a request raised in place of its output, as they end."""
        tasks = {asyncio.ensure_future(self.generate(*request)): position for position, request in enumerate(requests)}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                yield [(tasks[task], _outcome(task)) for task in done]
        finally:  # the caller went away (cancelled, or its worker died): stop the rest
            for task in pending:
                task.cancel()

    async def busy_s(self) -> float:
        """Seconds so far with at least one request in the engine (HTTP ones included): the trainer's measure
        of this server's idle time per step."""
        return self._busy.seconds()

    async def abort(self, request_id: str) -> int:
        # one pass of the event loop first: requests that ``generate_many`` has just taken start in that pass, and
        # an abort sent after them must find them in the engine
        await asyncio.sleep(0)
        return await self.engine.abort(request_id)

    async def in_flight(self) -> int:
        """Requests the engine has accepted and not answered yet."""
        return self.engine.num_in_flight

    async def update_weights(
        self, state_dict: dict[str, torch.Tensor] | PackedWeights | PackedAdapter, version: int | None = None
    ) -> int:
        """Copy new weights into the engine (prefix cache flushed); returns how many tensors were updated.

        ``version``: the trainer's number for these weights (default: one more than the last). A LoRA run pushes
        its adapter (``PackedAdapter``): the engine serves the base model with it; one with several adapters
        (``actor_rollout_ref.model.lora_adapters``) pushes them by name, which the engine serves side by side.
        """
        async with self._weights_changing(version):
            if isinstance(state_dict, PackedAdapter):
                return await self.engine.update_adapter(state_dict)
            if (
                isinstance(state_dict, dict)
                and state_dict
                and isinstance(next(iter(state_dict.values())), PackedAdapter)
            ):
                if not hasattr(self.engine, "update_adapters"):
                    raise ValueError(
                        f"{self.settings.section}.name={self.settings.name} serves one LoRA adapter at a time; several "
                        "(actor_rollout_ref.model.lora_adapters) need an engine that serves them side by side: vllm "
                        "or sglang"
                    )
                return await self.engine.update_adapters(state_dict)
            if isinstance(state_dict, PackedWeights):
                state_dict = state_dict.tensors()
            return await self.engine.update_weights(state_dict)

    async def update_weights_collective(self, group: WeightGroup, version: int | None = None) -> int:
        """Join ``group`` (``rollout.weight_sync=collective``) and load the weights its source broadcasts, bucket by
        bucket as they arrive where the engine can (``update_weights_in_buckets``), else all at once; ``version`` as
        for ``update_weights``. An engine whose server joins the group itself (SGLang: ``update_weights_over_group``)
        gets it once every member has reached the store. Returns how many tensors were updated."""
        receiver = WeightReceiver(group, self.rank)
        if hasattr(self.engine, "update_weights_over_group"):
            manifest = await asyncio.to_thread(receiver.gather)
            async with self._weights_changing(version):
                return await self.engine.update_weights_over_group(group, self.rank, manifest, version)
        manifest = await asyncio.to_thread(receiver.join)  # requests keep running while the members gather
        async with self._weights_changing(version):
            if hasattr(self.engine, "update_weights_in_buckets"):
                return await self.engine.update_weights_in_buckets(manifest, receiver.buckets())
            received = await asyncio.to_thread(
                lambda: {k: v for bucket in receiver.buckets() for k, v in bucket.items()}
            )
            return await self.engine.update_weights(received)

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Load new weights from a checkpoint directory (safetensors), flushing the prefix cache; ``version`` as
        for ``update_weights``."""
        async with self._weights_changing(version):
            await self.engine.update_weights_from_disk(model_path)

    @contextlib.asynccontextmanager
    async def _weights_changing(self, version: int | None) -> AsyncIterator[None]:
        """New requests wait until the update ends; then the version moves (unless the update failed)."""
        self._weights_settled.clear()
        try:
            yield
            self.policy_version = self.policy_version + 1 if version is None else int(version)
        finally:
            self._weights_settled.set()

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def start_http(self) -> str:
        """Serve ``/generate``, ``/v1/chat/completions`` and ``/health``; return the base URL."""
        if self.engine.http_url:  # the engine speaks SGLang's HTTP API itself
            return self.engine.http_url
        from transformers import AutoTokenizer

        from agentloop.models.loading import load_processor
        from agentloop.http_server import serve
        from agentloop.server.http import build_app

        http, model_path = self.settings.http, self.settings.model_path
        app = build_app(
            self,
            AutoTokenizer.from_pretrained(model_path),
            model_name=model_path,
            tool_format=self.settings.tool_format,
            api_key=http.api_key,
            max_body_bytes=http.max_body_bytes,
            processor=load_processor(model_path),
        )
        self.http_server, port = await serve(app, http.host, http.port + self.rank if http.port else 0)
        # a wildcard bind is reached through this node's address
        host = ray.util.get_node_ip_address() if http.host in ("0.0.0.0", "::") else http.host
        return f"http://{host}:{port}"

    async def shutdown(self) -> None:
        """Stop the HTTP front and the engine (a launched SGLang process included)."""
        if self.http_server is not None:
            self.http_server.should_exit = True
        await self.engine.shutdown()


def _outcome(task: asyncio.Task) -> TokenOutput | RayTaskError:
    """A finished request's output, or its error as Ray sends a failed call's back (the server's traceback with it,
    a cause it cannot pickle replaced by one it can): the router raises it as a lone call would."""
    if task.cancelled():
        return RayTaskError(
            "RolloutServer.generate", "", RuntimeError("the request was cancelled on the rollout server")
        )
    error = task.exception()
    if error is None:
        return task.result()
    return RayTaskError(
        "RolloutServer.generate", "".join(traceback.format_exception(type(error), error, error.__traceback__)), error
    )
