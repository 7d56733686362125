"""Engine ``hf``: transformers' continuous-batching manager as an async token-in/token-out engine.

The manager runs its own background thread (paged KV cache, prefix block sharing, per-request
temperature/top-k/top-p, per-token logprobs); this class turns its result callbacks into awaitables
on the caller's event loop and adds what RL needs on top: exact ids and logprobs, finish reasons,
cached-token counts, abort, in-place weight updates and sleep/wake of the KV cache. What it needs of
transformers beyond the public API sits in ``hf_batching``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from transformers import GenerationConfig

from agentloop.images import ProcessedImage
from agentloop.models.loading import is_vision_language, model_class, vision_token_ids
from agentloop.protocol import FinishReason, TokenOutput
from agentloop.server.sampling import finish_reason_of, id_list, validate_prompt, validate_sampling_params
from agentloop.server import hf_batching, hf_self_test, hf_varlen
from agentloop.server.adapters import PackedAdapter
from agentloop.server.engine import EngineAsleep
from agentloop.server.hf_batching import ContinuousBatchingConfig
from agentloop.server.hf_state import EngineState, Request
from agentloop.server.hf_vision import ImageLane
from agentloop.settings import ServerSettings

logger = logging.getLogger(__name__)

# how often a waiting request checks that the generation thread is still alive
WATCHDOG_S = 1.0
# the manager warns at every start that it does not know the token suppression a VLM's engine adds; it is stateless
logging.getLogger("ContinuousBatchingLogger").addFilter(
    lambda record: "SuppressTokensLogitsProcessor" not in record.getMessage()
)


def resolve_device(device: str) -> torch.device:
    """``auto`` means the visible CUDA device when there is one, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HFEngine:
    """Async token-in/token-out engine over ``model.init_continuous_batching``.

    Must be used from one asyncio event loop (the Ray actor's): results are delivered to it from the
    manager's thread with ``call_soon_threadsafe``.
    """

    http_url = None  # the rollout server hosts the HTTP front

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        dtype: str = "float32",
        page_size: int = 16,
        num_blocks: int = 512,
        max_batch_tokens: int = 1024,
        seed: int = 0,
        attention: str = "auto",
    ) -> None:
        self.device = resolve_device(device)
        self.model = (
            model_class(model_path)
            .from_pretrained(model_path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
            .to(self.device)
        )
        self._varlen = hf_varlen.wanted(attention, self.model)
        text_config = self.model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        # requests with images take the image lane (continuous batching cannot see pixels)
        self._lane = ImageLane(self.model, seed, self._batching_paused) if is_vision_language(model_path) else None
        # what one request may span: the model's positions, and the whole paged KV cache
        self.max_model_len = min(int(text_config.max_position_embeddings), page_size * num_blocks)
        self.eos_token_ids = id_list(self.model.generation_config.eos_token_id or text_config.eos_token_id)
        self._cb_config = dict(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
        self._seed, self._starts = seed, itertools.count()
        self._request_counter = itertools.count()
        self._requests: dict[str, Request] = {}  # by engine id: the caller's request id and a counter
        self._batcher = None
        self._state, self._failure = (
            EngineState.ASLEEP,
            None,
        )  # the failure: why a broken engine's manager would not start
        self._watchdog: asyncio.Task | None = None
        # the base weights of the modules a LoRA adapter adapts, kept aside at the first adapter push: each push
        # merges its adapter into them (the served weights are base + adapter)
        self._base_weights: dict[str, torch.Tensor] = {}
        hf_self_test.check(self, start=self._start_batcher, stop=self._stop_batcher)  # a broken release fails here

    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> HFEngine:
        """The servers' model with the ``rollout.hf`` cache sizing; rank r samples with seed + r."""
        return cls(
            settings.model_path,
            device=settings.hf.device,
            dtype=settings.dtype,
            page_size=settings.hf.page_size,
            num_blocks=settings.hf.num_blocks,
            max_batch_tokens=settings.hf.max_batch_tokens,
            seed=settings.seed + rank,
            attention=settings.hf.attention,
        )

    # ------------------------------------------------------------------ lifecycle

    def _start_batcher(self) -> None:
        """Build and start a batching manager: the engine serves, or is broken (and says why) when that fails."""
        try:
            manager = self._new_batcher()
        except Exception as error:
            self._state, self._failure = EngineState.BROKEN, error
            raise
        self._batcher, self._state = manager, EngineState.SERVING

    def _new_batcher(self) -> Any:
        # Per-request temperature/top-k/top-p processors exist only when the generation config sets
        # non-neutral defaults at creation; every request then passes its own values explicitly.
        generation_config = GenerationConfig(
            do_sample=True,
            temperature=0.5,
            top_k=self.vocab_size,
            top_p=0.99,
            eos_token_id=self.eos_token_ids or -1,
            pad_token_id=self.model.config.get_text_config().pad_token_id,
            suppress_tokens=vision_token_ids(self.model.config) or None,
        )
        cb_config = ContinuousBatchingConfig(
            **self._cb_config,
            # the manager seeds torch's sampler when it starts: a fresh seed per start (every wake-up)
            # keeps the samples of one step from repeating those of the step before
            seed=self._seed + 10007 * next(self._starts),
            return_logprobs=True,
            per_request_processors=True,
            auto_switch_to_flash=False,
        )
        self.model.set_attn_implementation("sdpa")  # the batching manager is built only on its own attention names
        manager = self.model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        if self._varlen:  # before start(): the manager's thread decides then whether to build dense masks
            self.model.set_attn_implementation(hf_varlen.NAME)
        hf_batching.observe_prefix_hits(manager, self._record_prefix_hit)
        hf_batching.skip_neutral_warpers(manager)
        hf_batching.sample_by_inverse_cdf(manager)
        manager.start()
        return manager

    def _record_prefix_hit(self, engine_id: str, matched_tokens: int) -> None:  # on the manager's thread
        if (request := self._requests.get(engine_id)) is not None:
            request.cached_tokens = matched_tokens

    def _stop_batcher(self, interrupt: bool = False) -> None:
        """Stop the batching loop; its requests end with the tokens and logprobs they have so far: ``abort``, or
        with ``interrupt`` (new weights are coming) ``interrupted``."""
        if self._batcher is None:
            return
        partial = hf_batching.partial_outputs(self._batcher, list(self._requests))
        for engine_id in list(self._requests):
            self._answer_unfinished(
                engine_id, partial.get(engine_id, ([], [])), "interrupted" if interrupt else "abort"
            )
        self._batcher.stop(block=True, timeout=30, keep_for_next_session=False, hard_stop=True)
        self._batcher, self._state = None, EngineState.ASLEEP  # (transformers' stop empties the accelerator's cache)

    def _check_serving(self) -> None:
        """Raise why the engine cannot serve, if it cannot: asleep, it wakes up; broken, it must be replaced."""
        if self._state is EngineState.ASLEEP:
            raise EngineAsleep("engine is asleep: call wake_up() before generate()")
        if self._state is EngineState.BROKEN:
            raise RuntimeError(
                f"engine is broken: starting its continuous-batching manager failed with {type(self._failure).__name__}: "
                f"{self._failure}. wake_up() cannot revive it: replace or restart the rollout server"
            ) from self._failure

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        images: list[ProcessedImage] | None = None,
    ) -> TokenOutput:
        """Generate from exact prompt ids (with ``images``: one image's pads each, expanded); return the sampled
        ids, their logprobs and why it stopped."""
        self._check_serving()
        params = validate_sampling_params(sampling_params)
        # checked before the request enters the batch: a bad id would fail the batch's forward pass
        prompt_ids = validate_prompt(prompt_ids, int(params["max_new_tokens"]), self.vocab_size, self.max_model_len)
        if any(not 0 <= int(token) < self.vocab_size for token in params["stop_token_ids"] or []):
            raise ValueError(f"stop_token_ids must be ids in [0, {self.vocab_size})")
        if images and self._lane is None:
            raise ValueError("the request has images, but this engine serves a text-only model")
        if self._lane is not None:  # image pads without their images would be embedded as text: wrong logprobs
            self._lane.check_pads(prompt_ids, images or [])
        self._restart_if_dead()
        stop_ids = list(params["stop_token_ids"] or [])
        if not params["ignore_eos"]:
            stop_ids += self.eos_token_ids
        if images:
            return await self._generate_with_images(prompt_ids, images, params, request_id, stop_ids)
        return await self._generate_batched(prompt_ids, params, request_id, stop_ids)

    async def _generate_batched(
        self, prompt_ids: list[int], params: dict[str, Any], request_id: str, stop_ids: list[int]
    ) -> TokenOutput:
        """One request through the continuous-batching manager."""
        greedy = params["temperature"] == 0
        top_k = self.vocab_size if params["top_k"] == -1 else min(int(params["top_k"]), self.vocab_size)
        engine_id = f"{request_id}#{next(self._request_counter)}"
        request = self._requests[engine_id] = Request(request_id, stop_ids, int(params["max_new_tokens"]))
        try:
            self._batcher.register_result_handler(engine_id, request.take)
            submitted = self._batcher.add_request(
                input_ids=list(prompt_ids),
                request_id=engine_id,
                max_new_tokens=request.max_new_tokens,
                eos_token_id=stop_ids or -1,
                # Greedy is top-1 sampling, so one manager serves greedy and sampled requests alike.
                temperature=1.0 if greedy else float(params["temperature"]),
                top_k=1 if greedy else top_k,
                top_p=1.0 if greedy else float(params["top_p"]),
            )
            if submitted is None:
                raise RuntimeError("the continuous-batching manager refused the request (it is stopping)")
            return await self._result(request.answer)
        except asyncio.CancelledError:  # its caller went away: free the batch of it too
            if self._batcher is not None:
                self._batcher.cancel_request(engine_id)
                hf_batching.drop_result_handler(self._batcher, engine_id)
            raise
        finally:
            self._requests.pop(engine_id, None)

    def _batching_paused(self) -> contextlib.AbstractContextManager:
        """Keeps the batching loop off the model (the image lane's steps run inside it)."""
        manager = self._batcher
        return manager.pause() if manager is not None and manager.is_running() else contextlib.nullcontext()

    async def _generate_with_images(
        self,
        prompt_ids: list[int],
        images: list[ProcessedImage],
        params: dict[str, Any],
        request_id: str,
        stop_ids: list[int],
    ) -> TokenOutput:
        engine_id = f"{request_id}#{next(self._request_counter)}"
        max_new_tokens = int(params["max_new_tokens"])
        result = await self._lane.generate(engine_id, request_id, prompt_ids, images, params, stop_ids, max_new_tokens)
        reason = finish_reason_of(result.token_ids, stop_ids, max_new_tokens, result.ended or "stop")
        return TokenOutput(result.token_ids, result.log_probs, reason, result.cached_tokens)

    async def _result(self, future: asyncio.Future[TokenOutput]) -> TokenOutput:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return await future

    async def _watch(self) -> None:
        # The manager's thread can die on an error no check foresaw: its requests would never be answered. One
        # watchdog for all of them, not a timed wait per request (that costs more than the rest of a request here).
        while self._requests:
            await asyncio.sleep(WATCHDOG_S)
            try:
                self._restart_if_dead()
            except Exception:  # its requests have been failed already; the engine is broken now and says so
                logger.exception("could not restart the continuous-batching thread")

    def _restart_if_dead(self) -> None:
        """Fail the requests of a manager whose generation thread died (or met a fatal error and is stopping),
        and start a fresh one."""
        manager = self._batcher
        if manager is None or hf_batching.is_healthy(manager):
            return
        logger.error(
            "the continuous-batching thread died; failing its %d request(s) and restarting it", len(self._requests)
        )
        for engine_id, request in list(self._requests.items()):
            request.fail(RuntimeError(f"request {engine_id} failed: the engine's generation thread died"))
        self._batcher = None
        with contextlib.suppress(Exception):  # dead or dying: stopping only waits for it and releases what is left
            manager.stop(block=True, timeout=30)
        self._start_batcher()

    async def abort(self, request_id: str) -> int:
        """Abort every in-flight generation of a session; each returns the tokens it has so far (as SGLang's do)
        with ``finish_reason='abort'``."""
        engine_ids = [engine_id for engine_id, request in self._requests.items() if request.session == request_id]
        partial = hf_batching.partial_outputs(self._batcher, engine_ids) if engine_ids else {}
        for engine_id in engine_ids:
            self._batcher.cancel_request(engine_id)
            self._answer_unfinished(engine_id, partial.get(engine_id, ([], [])), "abort")
        return len(engine_ids) + (self._lane.abort(request_id) if self._lane else 0)

    def _answer_unfinished(self, engine_id: str, partial: tuple[list[int], list[float]], reason: FinishReason) -> None:
        """Answer a request the manager never will (aborted, or interrupted by a weight update) with its tokens
        and logprobs so far (``partial``): ``reason``, unless they already end it."""
        hf_batching.drop_result_handler(self._batcher, engine_id)
        if (request := self._requests.get(engine_id)) is not None:
            request.finish(*partial, reason)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests) + (self._lane.num_in_flight if self._lane else 0)

    # ------------------------------------------------------------------ weights and memory

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy new weights into the model in place and flush the prefix cache (it holds stale KV).

        In-flight requests end ``interrupted`` with their tokens so far (sampled by the old weights); the
        router continues them under the new ones.
        """
        loaded = await self._load_weights(named_tensors)
        self._base_weights.clear()  # a new base: a later adapter merges into these weights
        return loaded

    async def update_adapter(self, adapter: PackedAdapter) -> int:
        """Serve base + ``adapter`` (a LoRA adapter, merged into the adapted modules' base weights, which the first
        push keeps aside); otherwise as ``update_weights``. Returns how many weight tensors changed."""
        params = dict(self.model.named_parameters())
        for module in adapter.scalings:
            name = f"{module}.weight"
            if name not in params:
                raise KeyError(f"update_adapter: the adapter adapts {module!r}, which the model lacks")
            if name not in self._base_weights:
                self._base_weights[name] = params[name].detach().clone()
        return await self._load_weights(adapter.merged_into(self._base_weights))

    async def _load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        # Check everything before touching anything: a bad push must not leave a half-updated model.
        targets = self._targets([(name, tuple(tensor.shape)) for name, tensor in named_tensors.items()])
        async with self._lane_paused(new_weights=True):
            with self._model_held(interrupt=True), torch.no_grad():
                for name, tensor in named_tensors.items():
                    if name in targets:
                        targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
        return len(targets)

    async def update_weights_in_buckets(
        self, manifest: list[tuple[str, str, tuple[int, ...]]], buckets: Iterator[dict[str, torch.Tensor]]
    ) -> int:
        """``update_weights`` for weights that arrive in buckets (``manifest``: every tensor's name, dtype and shape,
        checked first): each bucket is copied in as ``buckets`` yields it (a blocking iterator, read off the event
        loop), the model held throughout."""
        targets = self._targets([(name, tuple(shape)) for name, _, shape in manifest])
        async with self._lane_paused(new_weights=True):
            with self._model_held(interrupt=True), torch.no_grad():
                while (bucket := await asyncio.to_thread(next, buckets, None)) is not None:
                    for name, tensor in bucket.items():
                        if name in targets:
                            targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
        self._base_weights.clear()  # a new base: a later adapter merges into these weights
        return len(targets)

    def _targets(self, shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """The model's tensor for each pushed name (a tied output head left out); an error naming the first name the
        model lacks or whose shape differs."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        tied = self.model.config.tie_word_embeddings
        targets = {}
        for name, shape in shapes:
            if name not in params:
                if name == "lm_head.weight" and tied:
                    continue
                raise KeyError(f"update_weights: the model has no parameter {name!r}")
            if tuple(params[name].shape) != tuple(shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(shape)}, the model expects {tuple(params[name].shape)}"
                )
            targets[name] = params[name]
        return targets

    async def flush_cache(self) -> None:
        """Drop every cached prefix (in-flight requests are aborted)."""
        async with self._lane_paused(abort=True):
            with self._model_held():
                pass

    def _lane_paused(self, new_weights: bool = False, abort: bool = False) -> contextlib.AbstractAsyncContextManager:
        return self._lane.paused(new_weights, abort) if self._lane else contextlib.nullcontext()

    @contextlib.contextmanager
    def _model_held(self, interrupt: bool = False) -> Iterator[None]:
        """Keep the generation loop off the model inside the block; no cached prefix survives it.

        Idle and awake (weights pushed between rollouts without sleeping), the loop is paused in place and
        its cached prefix blocks are evicted: cheaper than a restart (transformers' ``stop`` runs two full
        ``gc.collect()`` passes). With requests in flight (or aborted but not yet dropped by the loop) the
        manager is restarted, which ends them: ``abort``, or with ``interrupt`` (a weight update)
        ``interrupted`` with their tokens so far, which the router continues under the new weights.
        """
        manager = self._batcher
        if manager is not None and not self._requests and manager.is_running():
            with manager.pause():
                if not hf_batching.has_pending_requests(manager):
                    try:
                        yield
                    finally:
                        hf_batching.evict_cached_blocks(manager)
                    return
        was_awake = manager is not None
        self._stop_batcher(interrupt)
        try:
            yield
        finally:
            if was_awake:
                self._start_batcher()

    async def update_weights_from_disk(self, model_path: str) -> None:
        """Load the ``*.safetensors`` of a checkpoint directory in place (prefix cache flushed)."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"update_weights_from_disk: no *.safetensors in {model_path!r}")
        if self._lane is not None:
            # a VLM's names on disk differ from its modules' (model.layers vs model.language_model.layers):
            # transformers' loader maps them
            state = (await asyncio.to_thread(model_class(model_path).from_pretrained, model_path)).state_dict()
        else:
            state = {}
            for file in files:
                state.update(load_file(file))
        await self.update_weights(state)

    async def sleep(self) -> None:
        """Free the KV cache (aborting in-flight requests); weights stay loaded."""
        async with self._lane_paused(abort=True):
            self._stop_batcher()

    async def wake_up(self) -> None:
        """Allocate a fresh KV cache and resume serving (a broken engine says why it cannot)."""
        if self._state is EngineState.ASLEEP:
            self._start_batcher()
        self._check_serving()

    @property
    def is_sleeping(self) -> bool:
        return self._state is EngineState.ASLEEP

    async def shutdown(self) -> None:
        async with self._lane_paused(abort=True):
            self._stop_batcher()
