"""The ``hf`` engine's start-up self-test: a transformers internal broken on purpose fails the engine's start
with the installed version, the tested range and the fix (the manager-level case is in test_startup_failure.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from agentloop.server import hf_batching, hf_self_test, hf_varlen
from agentloop.server.hf_engine import HFEngine
from agentloop.protocol import TokenOutput
from agentloop.server.hf_self_test import SelfTestFailed
from tests.support.broken_engines import attention_with_a_wrong_scale, raising_attention


@pytest.fixture
def broken_attention():
    def swap(function):
        AttentionInterface.register(hf_varlen.NAME, function)

    yield swap
    AttentionInterface.register(hf_varlen.NAME, hf_varlen.varlen_attention_forward)


def assert_names_version_range_and_fix(error: SelfTestFailed) -> None:
    message = str(error)
    assert f"transformers {transformers.__version__}" in message
    assert hf_batching.tested_range() in message and "transformers" in hf_batching.tested_range()
    assert "pip install -c constraints.txt" in message


def test_an_attention_function_that_raises_fails_the_start(model_path, broken_attention):
    broken_attention(raising_attention)
    with pytest.raises(SelfTestFailed, match="attention broken on purpose") as failure:
        HFEngine(model_path, device="cpu", num_blocks=64)
    assert_names_version_range_and_fix(failure.value)


def test_wrong_logprobs_fail_the_start(model_path, broken_attention):
    broken_attention(attention_with_a_wrong_scale)
    with pytest.raises(SelfTestFailed, match="differ from a plain forward pass") as failure:
        HFEngine(model_path, device="cpu", num_blocks=64)
    assert_names_version_range_and_fix(failure.value)


def test_a_missing_internal_fails_the_start(model_path, monkeypatch):
    monkeypatch.delattr(PagedAttentionCache, "search_prefix_match")
    with pytest.raises(SelfTestFailed, match="search_prefix_match") as failure:
        HFEngine(model_path, device="cpu", num_blocks=64)
    assert_names_version_range_and_fix(failure.value)


def test_a_request_that_hangs_fails_the_start_in_bounded_time(model_path, broken_attention, monkeypatch):
    released = threading.Event()

    def hanging_attention(*args, **kwargs):
        released.wait(120)
        raise RuntimeError("released")

    broken_attention(hanging_attention)
    monkeypatch.setattr(hf_self_test, "TIMEOUT_S", 3.0)
    try:
        with pytest.raises(SelfTestFailed, match="did not finish in 3s") as failure:
            HFEngine(model_path, device="cpu", num_blocks=64)
        assert_names_version_range_and_fix(failure.value)
    finally:
        released.set()  # the batching thread fails and ends


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_the_self_test_passes_on_both_attentions_and_leaves_the_prefix_cache_empty(model_path, attention):
    engine = HFEngine(model_path, device="cpu", num_blocks=64, attention=attention)
    try:
        first, _ = hf_self_test._prompts(engine, [2 * 16 + 5, 16 + 3])
        output = asyncio.run(engine.generate(first, {"max_new_tokens": 2}, "after-the-self-test"))
        assert output.cached_tokens == 0
    finally:
        asyncio.run(engine.shutdown())


def test_a_token_sampled_at_the_top_k_boundary_is_left_out_and_one_beyond_it_fails(model_path):
    """Low precision can swap the k-th and (k+1)-th scores between the engine and the plain forward: a token the
    forward ranks just past the boundary is not a failure; one far past it (top-k broken) still is."""
    engine = HFEngine(model_path, device="cpu", num_blocks=64, attention="sdpa")  # sdpa: a plain forward here too
    try:
        prompt = list(range(3, 20))
        with torch.no_grad():
            scores = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        ranked, order = scores.sort(descending=True)
        gaps = ranked[:-1] - ranked[1:]
        # the first k whose (k+1)-th token lies within the tolerance of the k-th: it stands just past the boundary
        k = int(torch.nonzero(gaps[1:] < hf_self_test.TOLERANCE[torch.float32])[0]) + 2
        beyond = len(ranked) - 1  # the lowest-ranked token: outside the top k by more than the tolerance
        assert ranked[beyond] < ranked[k - 1] - hf_self_test.TOLERANCE[torch.float32]
        params = {"temperature": 1.0, "top_k": k}
        at_boundary = TokenOutput(token_ids=[int(order[k])], log_probs=[-1.0], finish_reason="length")
        hf_self_test._compare(engine, prompt, at_boundary, params)
        with pytest.raises(AssertionError, match="differ from a plain forward pass by up to inf"):
            hf_self_test._compare(engine, prompt, TokenOutput([int(order[beyond])], [-1.0], "length"), params)
    finally:
        asyncio.run(engine.shutdown())
