"""The ``hf`` engine's lane for requests with images.

transformers' continuous batching takes token ids only: image pads fed to it run without error and give
wrong logprobs. Requests with images therefore run here, one model step at a time under a lock, on the
same model: the image prompt is prefilled with its pixels and M-RoPE positions (``get_rope_index``), then
decoded token by token with a ``DynamicCache``, sampled with transformers' temperature/top-k/top-p
warpers (log-probs under the filtered distribution, as the batching lane reports them).

The batching loop runs in its own thread on the same model, so each step here first pauses it
(``hold_batching``, the manager's ``pause``): run side by side, its forward passes disturbed this lane's
(logprobs off by up to 0.1 on the tiny model). Each session keeps its KV cache between turns; a later turn reuses the longest prefix whose ids match
and whose images have the same pixels (digests), so two images never share a cache entry even though
their pad ids are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, ContextManager

import torch
from cachetools import LRUCache
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from agentloop.images import ProcessedImage, image_inputs, mrope_positions
from agentloop.models.loading import vision_token_ids


@dataclass
class _SessionCache:
    ids: list[int]  # the tokens whose keys and values ``cache`` holds
    digests: list[str]  # the images among them, in order
    cache: DynamicCache


@dataclass
class LaneResult:
    token_ids: list[int]
    log_probs: list[float]
    ended: str | None  # "abort" or "interrupted" when cut short, else None (a stop token or the length limit)
    cached_tokens: int


class ImageLane:
    """Serves requests with images on ``model`` (a Qwen-VL ``...ForConditionalGeneration``)."""

    def __init__(
        self, model: Any, seed: int, hold_batching: Callable[[], ContextManager], max_sessions: int = 256
    ) -> None:
        self.model = model
        self.hold_batching = hold_batching
        self.image_token_id = int(model.config.image_token_id)
        self.vision_start_id = int(model.config.vision_start_token_id)
        self.lock = asyncio.Lock()
        self.sessions: LRUCache[str, _SessionCache] = LRUCache(max_sessions)
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.epoch = 0  # bumped by every weight update: requests begun before it end ``interrupted``
        self.aborted: set[str] = set()
        self.in_flight: dict[str, str] = {}  # engine id -> session
        self.suppress = SuppressTokensLogitsProcessor(vision_token_ids(model.config), device=model.device)
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns until 5.40)
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    async def generate(
        self,
        engine_id: str,
        session: str,
        prompt_ids: list[int],
        images: list[ProcessedImage],
        params: dict[str, Any],
        stop_ids: list[int],
        max_new_tokens: int,
    ) -> LaneResult:
        """Sample up to ``max_new_tokens`` after ``prompt_ids`` (expanded image pads) with ``images``."""
        epoch = self.epoch
        self.in_flight[engine_id] = session
        warpers = LogitsProcessorList([self.suppress, *_warpers(params)])
        tokens: list[int] = []
        log_probs: list[float] = []
        entry = self.sessions.pop(session, None)
        cached = 0
        try:
            async with self.lock:
                if ended := self._ended(engine_id, epoch):
                    return LaneResult([], [], ended, 0)
                entry, cached, logits, positions = await asyncio.to_thread(self._prefill, prompt_ids, images, entry)
            while True:
                token, log_prob = _sample(logits, warpers, self.generator)
                tokens.append(token)
                log_probs.append(log_prob)
                if token in stop_ids or len(tokens) >= max_new_tokens:
                    break
                async with self.lock:
                    if ended := self._ended(engine_id, epoch):
                        return LaneResult(tokens, log_probs, ended if ended == "interrupted" else "abort", cached)
                    positions = positions + 1
                    logits = await asyncio.to_thread(self._step, entry, token, positions)
            if self.epoch == epoch:  # KV computed under the current weights: keep it for the session's next turn
                self.sessions[session] = entry
            return LaneResult(tokens, log_probs, None, cached)
        finally:
            self.in_flight.pop(engine_id, None)
            self.aborted.discard(engine_id)

    def check_pads(self, prompt_ids: list[int], images: list[ProcessedImage]) -> None:
        """Every image needs exactly its expanded pads in the prompt, and every pad its image."""
        pads = prompt_ids.count(self.image_token_id)
        expected = sum(image.num_tokens for image in images)
        if pads != expected:
            raise ValueError(
                f"the prompt has {pads} image pad token(s) and its {len(images)} image(s) fill {expected}: "
                "each image needs exactly its expanded pads (agentloop.images.expand_image_pads)"
            )

    def _ended(self, engine_id: str, epoch: int) -> str | None:
        if engine_id in self.aborted:
            return "abort"
        return "interrupted" if self.epoch != epoch else None

    def abort(self, session: str) -> int:
        """Abort the session's requests in this lane; how many."""
        engine_ids = [engine_id for engine_id, owner in self.in_flight.items() if owner == session]
        self.aborted.update(engine_ids)
        return len(engine_ids)

    @contextlib.asynccontextmanager
    async def paused(self, new_weights: bool = False, abort: bool = False) -> AsyncIterator[None]:
        """Hold the model between steps and forget every session's KV cache. ``new_weights``: requests in
        flight end ``interrupted`` with their tokens so far; ``abort``: they end ``abort``."""
        if new_weights:
            self.epoch += 1
        if abort:
            self.aborted.update(self.in_flight)
        async with self.lock:
            self.sessions.clear()
            yield

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    # ------------------------------------------------------------------ model steps (in a worker thread)

    @torch.no_grad()
    def _prefill(
        self, prompt_ids: list[int], images: list[ProcessedImage], entry: _SessionCache | None
    ) -> tuple[_SessionCache, int, torch.Tensor, torch.Tensor]:
        """Forward what the session's cache lacks; the last logits and the positions of the last prompt token."""
        device = self.model.device
        ids = torch.tensor([prompt_ids], device=device)
        grid = torch.tensor([image.grid_thw for image in images], device=device)
        positions = mrope_positions(self.model, ids, grid)  # [4, 1, L]
        reuse, first_new_image = self._reusable(prompt_ids, images, entry)
        cache = entry.cache if reuse else DynamicCache(config=self.model.config)
        if cache.get_seq_length() > reuse:
            cache.crop(reuse - cache.get_seq_length())  # a negative count: the tokens to drop
        new_images = images[first_new_image:]
        vision = image_inputs(new_images) if new_images else {}
        with self.hold_batching():
            logits = self.model(
                input_ids=ids[:, reuse:],
                position_ids=positions[:, :, reuse:],
                **{self.cache_argument: cache},
                use_cache=True,
                logits_to_keep=1,
                **{key: value.to(device) for key, value in vision.items()},
            ).logits[0, -1]
        entry = _SessionCache(list(prompt_ids), [image.digest for image in images], cache)
        return entry, reuse, logits, positions[:, :, -1:]

    def _reusable(
        self, prompt_ids: list[int], images: list[ProcessedImage], entry: _SessionCache | None
    ) -> tuple[int, int]:
        """How many leading prompt tokens the cache holds correctly, and the first image after them."""
        if entry is None:
            return 0, 0
        limit = min(len(entry.ids), len(prompt_ids) - 1)  # at least one token is forwarded, for its logits
        length = next((i for i in range(limit) if entry.ids[i] != prompt_ids[i]), limit)
        # the images whose pads the prefix covers must be the same pictures; an image is reused whole or not at all
        image, position = 0, 0
        while image < len(images):
            start = prompt_ids.index(self.image_token_id, position)
            end = start + images[image].num_tokens
            if end > length or image >= len(entry.digests) or entry.digests[image] != images[image].digest:
                length = min(length, start)
                break
            image, position = image + 1, end
        while length and prompt_ids[length - 1] == self.vision_start_id:  # never split a vision block
            length -= 1
        return length, image

    @torch.no_grad()
    def _step(self, entry: _SessionCache, token: int, positions: torch.Tensor) -> torch.Tensor:
        """Forward one sampled token; the next logits."""
        text_position = torch.full_like(positions[:1], len(entry.ids))
        with self.hold_batching():
            logits = self.model(
                input_ids=torch.tensor([[token]], device=self.model.device),
                position_ids=torch.cat([text_position, positions[1:]]),
                **{self.cache_argument: entry.cache},
                use_cache=True,
            ).logits[0, -1]
        entry.ids.append(token)
        return logits


def _warpers(params: dict[str, Any]) -> LogitsProcessorList:
    """The sampling filters of one request: greedy is top-1 sampling, as in the batching lane."""
    if params["temperature"] == 0:
        return LogitsProcessorList([TopKLogitsWarper(1)])
    warpers = LogitsProcessorList([TemperatureLogitsWarper(float(params["temperature"]))])
    if params["top_k"] != -1:
        warpers.append(TopKLogitsWarper(int(params["top_k"])))
    if params["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(float(params["top_p"])))
    return warpers


def _sample(logits: torch.Tensor, warpers: LogitsProcessorList, generator: torch.Generator) -> tuple[int, float]:
    scores = warpers(None, logits.float().unsqueeze(0))
    log_probs = torch.log_softmax(scores, dim=-1)[0]
    token = int(torch.multinomial(log_probs.exp(), 1, generator=generator))
    return token, float(log_probs[token])
