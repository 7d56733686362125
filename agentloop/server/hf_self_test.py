"""The ``hf`` engine's start-up self-test: a few tokens through the real serving path, checked against a plain forward.

The engine leans on transformers' continuous-batching internals (``hf_batching``), which change between
releases without notice. Checking that attributes exist is not enough (transformers 5.24 kept every name and
moved the paged-cache update out of the attention functions), so a starting engine serves a few requests
through everything it relies on: continuous batching with the chosen attention, two requests packed in one
batch, the inverse-CDF sampler, top-k, the prefix cache and an abort. Their logprobs must equal those of a
plain forward pass of the same model. Any exception or mismatch fails the engine's start (and so its rollout
server's) with the installed version, the tested range and the fix, before any rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Callable

import torch
import transformers

from agentloop.models.loading import vision_token_ids, without_vision_tokens
from agentloop.protocol import TokenOutput
from agentloop.server import hf_batching

TIMEOUT_S = 300.0
# Largest |engine - plain forward| allowed on a sampled token's logprob. In float32 the two differ only in
# summation order (~1e-6); a broken internal (keys missing from attention, a wrong sampler) moves them by far
# more than these. Half precision rounds each layer's activations, so its bound is wider.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 0.1, torch.bfloat16: 0.25}
NEW_TOKENS = 6


class SelfTestFailed(RuntimeError):
    """The engine's serving path does not work with the installed transformers."""


def check(engine: Any, start: Callable[[], None], stop: Callable[[], None]) -> None:
    """Start an ``HFEngine``'s batching manager (``start``) and serve the self-test's requests on it; on any
    failure stop it (``stop``) and raise ``SelfTestFailed`` naming what broke and the fix."""
    outcome = None
    try:
        start()
        outcome = _in_own_thread(_exercise(engine))
        outcome.result(timeout=TIMEOUT_S)
    except Exception as error:
        if (
            outcome is not None and not outcome.done()
        ):  # a request hung in the batching thread: stopping would wait on it
            raise SelfTestFailed(
                failure_message(f"the self-test did not finish in {TIMEOUT_S:.0f}s (a request hung)")
            ) from None
        with contextlib.suppress(Exception):
            stop()
        if isinstance(error, SelfTestFailed):
            raise
        raise SelfTestFailed(failure_message(f"{type(error).__name__}: {error}")) from error


def _in_own_thread(coroutine: Any) -> concurrent.futures.Future:
    """Run ``coroutine`` on a loop of its own in a daemon thread (the engine may be built inside a running event
    loop, and a hung self-test must not keep the process from exiting)."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            outcome.set_result(asyncio.run(coroutine))
        except BaseException as error:  # noqa: BLE001 -- handed to the waiting thread
            outcome.set_exception(error)

    threading.Thread(target=run, name="hf-self-test", daemon=True).start()
    return outcome


def failure_message(problem: str) -> str:
    return (
        f"the hf engine's start-up self-test failed with transformers {transformers.__version__} "
        f"(agentloop is tested with {hf_batching.tested_range()}): {problem}. Fix: install the tested versions "
        f"(pip install -c constraints.txt -e . in the agentloop checkout, or pip install '{hf_batching.tested_range()}'), "
        "or adapt agentloop/server/hf_batching.py to this release"
    )


async def _exercise(engine: Any) -> None:
    page = int(engine._cb_config["page_size"])
    first, second = _prompts(engine, [2 * page + 5, page + 3])
    sampled = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
    narrowed = {**sampled, "temperature": 0.7, "top_k": 20}
    # two requests of different lengths in one batch: packed prefill, then decoding side by side
    outputs = await asyncio.gather(
        engine.generate(first, sampled, "self-test-a"), engine.generate(second, narrowed, "self-test-b")
    )
    checks = [(first, outputs[0], sampled), (second, outputs[1], narrowed)]
    # the first request's full pages are cached: a continuation reads them back instead of recomputing them
    continued = first + outputs[0].token_ids
    output = await engine.generate(continued, sampled, "self-test-c")
    if output.cached_tokens < page:
        raise AssertionError(
            f"a continuation of a {len(first)}-token prompt found {output.cached_tokens} tokens in the prefix cache"
        )
    checks.append((continued, output, sampled))
    checks.append((second, await _aborted(engine, second, {**sampled, "max_new_tokens": 64}), sampled))
    for prompt, output, params in checks:
        _compare(engine, prompt, output, params)
    with engine._batching_paused():
        hf_batching.evict_cached_blocks(engine._batcher)  # the served engine starts with an empty prefix cache


def _prompts(engine: Any, lengths: list[int]) -> list[list[int]]:
    """Fixed pseudo-random ids of the vocabulary, none an end of sequence or a vision token."""
    forbidden = set(engine.eos_token_ids) | set(vision_token_ids(engine.model.config))
    allowed = torch.tensor(sorted(set(range(engine.vocab_size)) - forbidden))
    generator = torch.Generator().manual_seed(0)
    return [allowed[torch.randint(len(allowed), (length,), generator=generator)].tolist() for length in lengths]


async def _aborted(engine: Any, prompt: list[int], params: dict) -> TokenOutput:
    """A request aborted while it generates: it must answer with its tokens so far and leave the batch."""
    request = asyncio.ensure_future(engine.generate(prompt, params, "self-test-abort"))
    while engine.num_in_flight == 0 and not request.done():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await engine.abort("self-test-abort")
    output = await request
    if output.finish_reason not in ("abort", "length"):
        raise AssertionError(f"an aborted request ended with finish_reason {output.finish_reason!r}")
    deadline = time.monotonic() + 30
    while hf_batching.has_pending_requests(engine._batcher):
        if time.monotonic() > deadline:
            raise AssertionError("an aborted request was still in the batch 30 s later")
        await asyncio.sleep(0.01)
    return output


def _compare(engine: Any, prompt: list[int], output: TokenOutput, params: dict) -> None:
    """The logprobs the engine returned against a plain forward of the same model (sdpa, no paged cache)."""
    if len(output.token_ids) != len(output.log_probs):
        raise AssertionError(f"{len(output.token_ids)} tokens came back with {len(output.log_probs)} logprobs")
    if not output.token_ids:
        return
    model = engine.model
    with engine._batching_paused():
        attention = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            with torch.no_grad():
                ids = torch.tensor([prompt + output.token_ids], device=model.device)
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        finally:
            model.set_attn_implementation(attention)
    tolerance = TOLERANCE.get(model.dtype, 0.25)
    tokens = torch.tensor(output.token_ids, device=model.device)[:, None]
    scores = without_vision_tokens(logits, model.config) / params["temperature"]
    compared = torch.ones(len(output.token_ids), dtype=torch.bool, device=model.device)
    if params.get("top_k", -1) != -1:
        kth = scores.topk(params["top_k"], dim=-1).values[:, -1:]
        # In low precision the engine's k-th and (k+1)-th scores can swap places against this forward: a token
        # sampled at that boundary has no reference logprob here, so it is left out rather than counted as inf.
        chosen = scores.gather(1, tokens)
        compared = ((chosen >= kth) | (chosen < kth - tolerance))[:, 0]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    expected = torch.log_softmax(scores, dim=-1).gather(1, tokens)[:, 0]
    returned = torch.tensor(output.log_probs, device=model.device)
    difference = (returned - expected)[compared].abs().max().item() if compared.any() else 0.0
    if not difference <= tolerance:
        raise AssertionError(f"the engine's logprobs differ from a plain forward pass by up to {difference:.3g}")
