"""``RewardModelServer``: a discriminative reward model (verl's DisRM), a sequence-classification checkpoint, for
one data-parallel rank of the judge's pool; it answers the pool's probes and controls as a ``RolloutServer`` does."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
import torch
from transformers import AutoModelForSequenceClassification

from agentloop.server.accounting import BusyClock, node_info
from agentloop.server.hf_engine import resolve_device
from agentloop.settings import ServerSettings


@ray.remote
class RewardModelServer:
    """``score(ids)``: the model's first logit at the last token of a rendered conversation."""

    def __init__(self, settings: ServerSettings, rank: int) -> None:
        torch.set_num_threads(settings.cpus)
        self.rank = rank
        self.device = resolve_device(settings.hf.device)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                settings.model_path, dtype=getattr(torch, settings.dtype)
            )
            .to(self.device)
            .eval()
        )
        self._busy = BusyClock()

    async def score(self, ids: list[int]) -> float:
        with self._busy.request():
            return await asyncio.to_thread(self._forward, ids)  # the event loop keeps answering probes

    @torch.no_grad()
    def _forward(self, ids: list[int]) -> float:
        return float(self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0, 0])

    async def in_flight(self) -> int:
        return self._busy.active

    async def busy_s(self) -> float:
        return self._busy.seconds()

    def node_info(self) -> dict[str, Any]:
        return node_info(self.rank)

    async def sleep(self) -> None:
        """Nothing to release: a reward model keeps no cache."""

    async def wake_up(self) -> None:
        """Nothing to restore."""

    async def shutdown(self) -> None:
        """Nothing to stop beyond the actor."""
