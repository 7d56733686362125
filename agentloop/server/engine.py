"""The engine contract: what every rollout backend implements, and the table that names the backends.

A ``RolloutServer`` hosts one engine and calls it only through this contract, from the actor's event
loop. Adding a backend is one file with a class that satisfies ``Engine`` plus one entry in
``ENGINES`` (or a dotted class path in ``actor_rollout_ref.rollout.name``); it is built from the servers'
``ServerSettings`` (``agentloop.settings``).
"""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

import torch
from hydra.utils import get_class

from agentloop.images import ProcessedImage
from agentloop.protocol import TokenOutput
from agentloop.server.adapters import PackedAdapter
from agentloop.settings import ServerSettings


class EngineAsleep(RuntimeError):
    """A request reached an engine whose KV cache is released (``sleep``); the HTTP front answers 503."""


# rollout.name -> the engine class, imported only when chosen (the HTTP clients need no GPU, hf no aiohttp)
ENGINES: dict[str, str] = {
    "hf": "agentloop.server.hf_engine.HFEngine",
    "sglang": "agentloop.server.sglang_engine.SGLangEngine",
    "vllm": "agentloop.server.vllm_engine.VLLMEngine",
}


@runtime_checkable
class Engine(Protocol):
    """A token-in/token-out inference engine for one data-parallel rank.

    Every call is a coroutine, whether the backend works in-process (``hf``) or over HTTP (``sglang``).
    ``http_url`` is the base URL of an engine that already serves SGLang's HTTP API itself (the
    server then exposes that URL); None means the server hosts its own HTTP front over this engine.
    """

    http_url: str | None

    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> Engine:
        """Build the engine of data-parallel rank ``rank`` from its servers' settings."""

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict, request_id: str, images: list[ProcessedImage] | None = None
    ) -> TokenOutput:
        """One turn: sample from exact prompt ids; ids, their logprobs and why it stopped. ``images``: the
        conversation's images in order, their expanded pads in ``prompt_ids`` (passed only when there are
        some, so a text-only engine may leave the argument out)."""

    async def abort(self, request_id: str) -> int:
        """Abort the session's in-flight requests (they return ``finish_reason='abort'``); how many."""

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Load new weights in place and flush the prefix cache; how many tensors were loaded. Requests in
        flight end ``interrupted`` with the tokens they have (the router continues them under the new weights)."""

    async def update_adapter(self, adapter: PackedAdapter) -> int:
        """Serve the base model with a LoRA ``adapter`` (replacing the previous one), otherwise as
        ``update_weights``. An engine that serves several adapters side by side (``vllm``, ``sglang``) also has
        ``update_adapters({name: adapter})``, and its ``generate`` takes ``adapter=name`` (not part of the contract:
        the rollout server calls them only when a run has several, ``actor_rollout_ref.model.lora_adapters``)."""

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load the weights of a checkpoint directory in place and flush the prefix cache."""

    async def sleep(self) -> None:
        """Release the KV cache (in-flight requests are aborted); weights stay loaded."""

    async def wake_up(self) -> None:
        """Allocate the KV cache again and serve."""

    async def flush_cache(self) -> None:
        """Drop every cached prefix."""

    async def shutdown(self) -> None:
        """Release the engine's resources (threads, processes, connections)."""

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet answered."""

    @property
    def is_sleeping(self) -> bool:
        """Whether ``sleep`` released the KV cache and ``wake_up`` has not restored it."""


def build_engine(settings: ServerSettings, rank: int) -> Engine:
    """The engine named by ``rollout.name`` (a key of ``ENGINES`` or a dotted class path)."""
    name = settings.name
    path = ENGINES.get(name) or (name if "." in name else None)
    if path is None:
        raise ValueError(
            f"{settings.section}.name={name!r} is not a known backend; available: {sorted(ENGINES)} "
            "(or a dotted path to a class implementing agentloop.server.engine.Engine)"
        )
    try:
        cls = get_class(path)
    except Exception as error:
        raise ValueError(f"{settings.section}.name={name!r}: {path!r} cannot be imported: {error}") from error
    return cls.from_settings(settings, rank)
