"""Every use the ``hf`` engine makes of transformers' continuous-batching internals, in one place.

transformers' public continuous-batching API (``init_continuous_batching``, ``add_request``,
``register_result_handler``, ``cancel_request``, ``pause``) lacks what RL rollouts need: the
count of prompt tokens served from the prefix cache, answering a cancelled request (the manager
sends no output for it), the tokens an interrupted request has so far, dropping cached prefixes
after an in-place weight update, skipping the top-k/top-p sorts for batches that sample from the
whole vocabulary, sampling without a random number per vocabulary entry, and reading the paged
cache from an attention function of our own (``hf_varlen``). Those reach into private attributes
that change between releases: the engine's start-up self-test (``hf_self_test``) runs each of them
on real tokens before the server takes a request, so a release that breaks one fails the start
with a message naming the tested range, not a rollout.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable

import torch
import transformers


def tested_range() -> str:
    """The transformers versions this agentloop declares (and was tested with), from its package metadata."""
    try:
        requirements = metadata.requires("agentloop") or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "the range in agentloop's pyproject.toml"
    declared = next(
        (r for r in requirements if r.replace(" ", "").startswith("transformers") and "extra" not in r), None
    )
    return declared.replace(" ", "") if declared else "the range in agentloop's pyproject.toml"


try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingTopKLogitsWarper,
        ContinuousBatchingTopPLogitsWarper,
    )
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
except ImportError as error:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        f"the hf engine needs transformers' continuous batching; transformers {transformers.__version__} lacks it "
        f"({error}). Install {tested_range()} (pip install -c constraints.txt -e . installs the tested set)."
    ) from error

__all__ = ["ContinuousBatchingConfig", "GenerationOutput", "RequestStatus", "paged_keys_and_values", "tested_range"]


def paged_keys_and_values(
    module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's keys and values, packed, for one layer's attention in a continuous-batching step.

    Up to transformers 5.23 the attention function was handed the paged cache (``cache``) and wrote the new
    keys to it itself, as transformers' own attention functions did; from 5.24 the model's attention layer
    updates the cache before calling the attention function, which receives the keys read back from it.
    """
    cache = kwargs.pop("cache", None)
    if isinstance(cache, PagedAttentionCache):
        return cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    return key, value


def _when_built(manager: Any, adapt: Callable[[Any], None]) -> None:
    """Call ``adapt(processor)`` on each batch processor the manager builds. It builds them (with their cache and
    model runner) in its own thread when it starts, so the factory is wrapped before ``start()``."""
    create_processor = manager._create_batch_processor

    def create_and_adapt() -> Any:
        processor = create_processor()
        adapt(processor)
        return processor

    manager._create_batch_processor = create_and_adapt


def observe_prefix_hits(manager: Any, record: Callable[[str, int], None]) -> None:
    """Call ``record(request_id, matched_tokens)`` on every prefix-cache lookup of this manager."""

    def observe(processor: Any) -> None:
        search = processor.cache.search_prefix_match

        def observed_search(request_id: str, prompt_ids: list[int]) -> int:
            matched = search(request_id, prompt_ids)
            record(request_id, matched)
            return matched

        processor.cache.search_prefix_match = observed_search

    _when_built(manager, observe)


def is_healthy(manager: Any) -> bool:
    """The manager's thread runs and takes requests: not stopping, as it does after a fatal error."""
    return manager.is_running() and manager.background_thread_status.can_accept_new_requests() is None


def drop_result_handler(manager: Any, request_id: str) -> None:
    """Forget a cancelled request's result callback (the manager never delivers one for it)."""
    router = manager.output_router
    with router._lock:
        router.result_handlers.pop(request_id, None)


def has_pending_requests(manager: Any) -> bool:
    """Whether the batching loop still holds requests (cancelled ones included until it drops them)."""
    return manager.batch_processor.has_pending_requests()


def partial_outputs(manager: Any, request_ids: list[str]) -> dict[str, tuple[list[int], list[float]]]:
    """The tokens and logprobs each request in flight has generated so far, read while the loop is paused
    (a request that already finished, or whose state is gone, is absent)."""
    processor = getattr(manager, "batch_processor", None)
    if processor is None or not manager.is_running():
        return {}
    scheduler = processor.scheduler
    found = {}
    with manager.pause():
        for request_id in request_ids:
            state = scheduler.active_requests.get(request_id) or scheduler.waiting_requests.get(request_id)
            if state is not None:
                # A request the cache could not hold was soft reset: its tokens so far moved into its prompt, so
                # the output, not ``generated_tokens``, has them all.
                output = state.to_generation_output()
                count = min(len(output.generated_tokens), len(output.logprobs))
                found[request_id] = (list(output.generated_tokens[:count]), [float(x) for x in output.logprobs[:count]])
    return found


def evict_cached_blocks(manager: Any) -> None:
    """Drop every cached prefix block: KV computed under old weights must not be reused."""
    manager.batch_processor.cache.evict_cached_blocks()


class _SkippedWhenNeutral(ContinuousBatchingLogitsProcessor):
    """A per-request top-k or top-p warper that leaves a batch alone when no request in it narrows the
    vocabulary. Its full-vocabulary sorts would change nothing then, yet cost on CPU about a fifth of a
    small model's decoding step."""

    def __init__(
        self, warper: ContinuousBatchingLogitsProcessor, is_neutral: Callable[[torch.Tensor, int], torch.Tensor]
    ) -> None:
        self.warper, self.is_neutral = warper, is_neutral
        self.supported_kwargs, self.ignored_kwargs = warper.supported_kwargs, warper.ignored_kwargs

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        self.warper.fill_defaults(int32_tensor)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return self.warper.prepare_tensor_args(requests_with_new_token)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if bool(self.is_neutral(tensor_arg[: scores.size(0)], scores.size(-1)).all()):
            return scores
        return self.warper(scores, tensor_arg)


_NEUTRAL = {
    ContinuousBatchingTopKLogitsWarper: lambda top_k, vocab_size: top_k >= vocab_size,
    ContinuousBatchingTopPLogitsWarper: lambda top_p, vocab_size: top_p.view(dtype=torch.float32) >= 1.0,
}


def skip_neutral_warpers(manager: Any) -> None:
    """On CPU, run the top-k and top-p warpers only for batches where some request sets them.

    Not on accelerators: there the check would cost a device sync per step, and a captured CUDA graph
    or compiled step cannot branch on it.
    """
    if manager.model.device.type != "cpu":
        return
    if not hasattr(manager, "logit_processor"):
        raise RuntimeError(
            f"transformers {transformers.__version__}'s continuous-batching manager has no logit_processor"
        )
    processors = manager.logit_processor.logits_processor
    for index, processor in enumerate(processors):
        if type(processor) in _NEUTRAL:
            processors[index] = _SkippedWhenNeutral(processor, _NEUTRAL[type(processor)])


def sample_by_inverse_cdf(manager: Any) -> None:
    """On CPU, draw each next token with one uniform number per request (``inverse_cdf_sample``) instead of
    ``torch.multinomial``, which draws one exponential per vocabulary entry: at 128 requests and a
    thousand-token vocabulary that was a fifth of a small model's decoding step. The same distribution (to
    float64 rounding), the same log-probs (of the softmax, as transformers computes them)."""
    if manager.model.device.type != "cpu":
        return

    def replace_sampler(processor: Any) -> None:
        runner = processor.model_runner
        original = runner._sample

        def sample(scores: torch.Tensor, output_ids: torch.Tensor) -> None:
            if not (
                runner.do_sample and runner.return_logprobs
            ):  # the engine always sets both; anything else as before
                return original(scores, output_ids)
            probs = torch.softmax(scores[0], dim=-1)  # [requests, vocabulary]
            tokens = inverse_cdf_sample(probs)
            log_probs = probs.gather(1, tokens[:, None]).squeeze(1).log()
            # transformers' output layout: row 0 the tokens, row 1 their fp32 log-probs stored as int32 bits
            output_ids[0, : tokens.size(0)].copy_(tokens)
            output_ids[1, : tokens.size(0)].copy_(log_probs.view(dtype=torch.int32))

        runner._sample = sample

    _when_built(manager, replace_sampler)


def inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` ([rows, entries], rows summing to about 1), drawn with probability
    proportional to its entry: the first index whose running sum reaches a uniform draw in (0, row total].
    An entry of probability 0 is never drawn (its running sum equals its predecessor's). The sums are in
    float64: in float32 an entry under about 6e-8 would add nothing to a sum near 1 and never be drawn."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise RuntimeError(
            "the next-token probabilities of a request hold inf or nan (or are all zero): the model's logits are not finite"
        )
    draw = (1.0 - torch.rand(cdf.size(0), 1, dtype=cdf.dtype)) * total
    return torch.searchsorted(cdf, draw).squeeze(1)
