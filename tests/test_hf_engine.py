"""Engine ``hf`` on the real tiny model: exact logprobs, sampling controls, abort, weights, sleep/wake."""

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentloop.server.engine import EngineAsleep
from agentloop.server.hf_batching import inverse_cdf_sample
from agentloop.server.hf_engine import HFEngine

PROMPT = list(range(3, 40))

# fp32 on both sides; the engine's paged attention and the plain forward differ only in summation
# order, which moves logprobs by ~1e-6. 1e-4 is far below any policy change the trainer could see.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(model_path):
    engine = HFEngine(model_path, device="cpu", num_blocks=256, seed=0)
    yield engine
    run(engine.shutdown())


def run(coroutine):
    return asyncio.run(coroutine)


def teacher_forced_logprobs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return log_probs.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_forward(engine, model_path, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    params = {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True}
    outputs = run(_gather(engine, [PROMPT, PROMPT[:20], PROMPT[5:]], params))
    for prompt, output in zip([PROMPT, PROMPT[:20], PROMPT[5:]], outputs):
        assert len(output.token_ids) == len(output.log_probs) == 24
        reference = teacher_forced_logprobs(model, prompt, output.token_ids, temperature)
        assert torch.allclose(torch.tensor(output.log_probs), reference, atol=LOGPROB_TOLERANCE)


async def _gather(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params, f"lp-{i}") for i, p in enumerate(prompts)))


def test_finish_reasons_stop_ids_and_greedy(engine):
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    first = run(engine.generate(PROMPT, greedy, "g1"))
    second = run(engine.generate(PROMPT, greedy, "g2"))
    assert first.token_ids == second.token_ids and first.finish_reason == "length"
    # stopping on the third greedy token: it is the last token returned, and the reason is "stop"
    stop_at = first.token_ids[2]
    stopped = run(engine.generate(PROMPT, {**greedy, "stop_token_ids": [stop_at]}, "g3"))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]


def test_top_k_one_is_greedy(engine):
    greedy = run(engine.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, "a"))
    top1 = run(engine.generate(PROMPT, {"max_new_tokens": 6, "temperature": 1.0, "top_k": 1, "ignore_eos": True}, "b"))
    assert top1.token_ids == greedy.token_ids
    assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in top1.log_probs)


def test_prefix_cache_reports_cached_tokens(engine):
    params = {"max_new_tokens": 2, "temperature": 0.0}
    run(engine.generate(PROMPT, params, "p1"))
    again = run(engine.generate(PROMPT + [7, 8], params, "p2"))
    # page_size 16: two full pages of the 37-token prompt are shared
    assert again.cached_tokens == 32


def test_unknown_and_invalid_sampling_params(engine):
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['max_tokens'\].*valid keys"):
        run(engine.generate(PROMPT, {"max_tokens": 4}, "bad"))
    with pytest.raises(ValueError, match="top_p"):
        run(engine.generate(PROMPT, {"top_p": 0.0}, "bad"))


def test_abort_returns_partial_with_reason(engine):
    async def scenario():
        task = asyncio.create_task(engine.generate(PROMPT, {"max_new_tokens": 4000, "ignore_eos": True}, "long"))
        while engine.num_in_flight == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert await engine.abort("long") == 1
        return await asyncio.wait_for(task, timeout=10)

    output = run(scenario())
    assert output.finish_reason == "abort"
    assert engine.num_in_flight == 0
    # the tokens it had, each with its logprob (as SGLang's abort returns them)
    assert 0 < len(output.token_ids) == len(output.log_probs) < 4000


def test_update_weights_changes_generation_and_sleep_wake_round_trip(engine, model_path):
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    before = run(engine.generate(PROMPT, greedy, "w0")).token_ids
    original = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    torch.manual_seed(1)
    perturbed = {name: tensor + 0.5 * torch.randn_like(tensor) for name, tensor in original.items()}
    assert run(engine.update_weights(perturbed)) > 0
    changed = run(engine.generate(PROMPT, greedy, "w1")).token_ids
    assert changed != before

    run(engine.sleep())
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        run(engine.generate(PROMPT, greedy, "w2"))
    run(engine.wake_up())
    assert run(engine.generate(PROMPT, greedy, "w3")).token_ids == changed

    run(engine.update_weights(original))
    assert run(engine.generate(PROMPT, greedy, "w4")).token_ids == before


def test_update_while_idle_drops_cached_prefixes_and_serves_the_new_weights(engine, model_path):
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    run(engine.generate(PROMPT, params, "cache-1"))
    assert run(engine.generate(PROMPT, params, "cache-2")).cached_tokens == 32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(2)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(0.1 * torch.randn_like(tensor))
    manager = engine._batcher
    run(engine.update_weights(model.state_dict()))
    assert engine._batcher is manager, "an idle engine is updated in place, without restarting its batching loop"
    # KV cached under the old weights would be stale: nothing may be reused, and logprobs follow the new model
    output = run(engine.generate(PROMPT, params, "cache-3"))
    assert output.cached_tokens == 0
    reference = teacher_forced_logprobs(model, PROMPT, output.token_ids)
    assert torch.allclose(torch.tensor(output.log_probs), reference, atol=LOGPROB_TOLERANCE)
    run(engine.update_weights(original))


def test_waking_up_does_not_replay_the_samples_of_before(engine):
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    before = run(engine.generate(PROMPT, params, "rng-1")).token_ids
    run(engine.sleep())
    run(engine.wake_up())
    assert run(engine.generate(PROMPT, params, "rng-2")).token_ids != before


def test_an_engine_whose_manager_cannot_start_again_is_broken_not_asleep(model_path):
    engine = HFEngine(model_path, device="cpu", num_blocks=64, seed=0)
    try:
        run(engine.sleep())
        engine._cb_config["page_size"] = (
            0  # a KV cache transformers refuses to build: the wake-up cannot start a manager
        )
        with pytest.raises(ValueError, match="page_size must be at least"):
            run(engine.wake_up())
        assert not engine.is_sleeping
        # asleep would say "call wake_up()"; broken names the failure and that only a new server serves again
        for call in (lambda: engine.generate(PROMPT, {"max_new_tokens": 2}, "after"), engine.wake_up):
            with pytest.raises(
                RuntimeError, match=r"broken.*ValueError: page_size must be at least.*replace"
            ) as raised:
                run(call())
            assert not isinstance(raised.value, EngineAsleep) and "call wake_up()" not in str(raised.value)
        assert engine.num_in_flight == 0
    finally:
        run(engine.shutdown())


def test_update_weights_rejects_wrong_names_and_shapes(engine):
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        run(engine.update_weights({"nope": torch.zeros(1)}))
    name, tensor = next(iter(engine.model.state_dict().items()))
    with pytest.raises(ValueError, match="shape"):
        run(engine.update_weights({name: torch.zeros(tensor.numel() + 1)}))
    assert run(engine.generate(PROMPT, {"max_new_tokens": 2}, "alive")).token_ids


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the point
def test_bad_prompts_fail_alone_and_a_dead_generation_thread_is_replaced(engine):
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    expected = run(engine.generate(PROMPT, greedy, "before")).token_ids
    bad = (
        ([engine.vocab_size], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        ([], "empty"),
        (["7"], "integer token ids"),
        ([1] * 5000, "exceeds this engine's limit of 4096 tokens"),
    )
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            run(engine.generate(prompt, {"max_new_tokens": 4}, "bad"))
    assert run(engine.generate(PROMPT, greedy, "after-bad")).token_ids == expected

    # a fault no check foresaw, raised inside the generation thread: it fails the request it touched only
    original = engine.model.forward

    def fails_once(*args, **kwargs):
        engine.model.forward = original
        raise RuntimeError("injected fault")

    engine.model.forward = fails_once
    with pytest.raises(RuntimeError, match="injected fault|generation thread died"):
        run(asyncio.wait_for(engine.generate(PROMPT, greedy, "victim"), timeout=60))
    assert run(asyncio.wait_for(engine.generate(PROMPT, greedy, "after-fault"), timeout=60)).token_ids == expected
    assert engine.num_in_flight == 0

    # a thread that dies without failing its requests (an exception transformers' loop does not catch): the
    # engine's watchdog fails them within a second or so, and the next request gets a fresh thread
    processor = engine._batcher.batch_processor
    prepare = processor.prepare_next_batch

    def dies_with_a_request_in_hand() -> bool:
        if prepare():
            raise SystemExit
        return False

    processor.prepare_next_batch = dies_with_a_request_in_hand
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="generation thread died"):
        run(asyncio.wait_for(engine.generate(PROMPT, greedy, "stranded"), timeout=60))
    assert time.monotonic() - start < 30
    assert run(asyncio.wait_for(engine.generate(PROMPT, greedy, "after-death"), timeout=60)).token_ids == expected
    assert engine.num_in_flight == 0


def test_per_request_attention_matches_one_sdpa_call_per_request():
    from agentloop.server.hf_varlen import varlen_attention

    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    lengths_q, lengths_k = (
        [1, 7, 1, 3, 12, 1],
        [9, 7, 30, 10, 12, 1],
    )  # decodes, a fresh prefill, prefill chunks after a cache hit
    query = torch.randn(heads, sum(lengths_q), dim)
    key, value = torch.randn(2, kv_heads, sum(lengths_k), dim)
    cumulative = lambda lengths: torch.tensor([0, *lengths]).cumsum(0).int()  # noqa: E731
    output = varlen_attention(query, key, value, cumulative(lengths_q), cumulative(lengths_k), scaling=0.3)

    starts_q, starts_k = cumulative(lengths_q).tolist(), cumulative(lengths_k).tolist()
    for i, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        q = query[:, starts_q[i] : starts_q[i] + n_q]
        k, v = (x[:, starts_k[i] : starts_k[i] + n_k].repeat_interleave(heads // kv_heads, 0) for x in (key, value))
        scores = (q @ k.transpose(1, 2)) * 0.3
        # query j is token n_k - n_q + j of the request: it sees the keys up to itself
        scores[:, torch.arange(n_q)[:, None] < torch.arange(n_k)[None, :] - (n_k - n_q)] = float("-inf")
        expected = (scores.softmax(-1) @ v).transpose(0, 1)
        assert torch.allclose(output[starts_q[i] : starts_q[i] + n_q], expected, atol=1e-5), f"request {i}"


def test_inverse_cdf_sampling_draws_each_token_with_its_probability():
    # the CPU engine's sampler (hf_batching.sample_by_inverse_cdf): one uniform draw per request
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.0, 0.125, 0.0])
    rows = 200_000
    drawn = inverse_cdf_sample(probs.expand(rows, -1).contiguous())
    share = torch.bincount(drawn, minlength=len(probs)) / rows
    assert share[probs == 0].sum() == 0  # a token the warpers ruled out is never drawn, the first and last included
    assert torch.allclose(share, probs, atol=0.006)  # 5 standard deviations of the largest share at this many draws
    top_1 = torch.zeros(1000, 8)
    top_1[:, 6] = 1.0
    assert (inverse_cdf_sample(top_1) == 6).all()  # greedy is top-1 sampling


def test_a_busy_batch_keeps_exact_logprobs_and_each_request_its_own_top_k(engine, model_path):
    assert engine._varlen  # on CPU the engine attends per request (agentloop.server.hf_varlen)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(12)]
    sampled = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    first = run(_gather(engine, prompts, sampled))
    # second turns hit the prefix cache: their queries are the last of their keys
    follow_ups = [p + o.token_ids + [7, 8, 9] for p, o in zip(prompts, first)]

    async def mixed():
        top1 = engine.generate(follow_ups[0], {**sampled, "top_k": 1}, "top1")
        return await asyncio.gather(
            top1, *(engine.generate(p, sampled, f"lp2-{i}") for i, p in enumerate(follow_ups[1:]))
        )

    second = run(mixed())
    for prompt, output in [*zip(prompts, first), *zip(follow_ups[1:], second[1:])]:
        assert torch.allclose(
            torch.tensor(output.log_probs),
            teacher_forced_logprobs(model, prompt, output.token_ids),
            atol=LOGPROB_TOLERANCE,
        )
    assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in second[0].log_probs)  # top-1: the warped distribution's
    assert all(lp < -1e-3 for output in second[1:] for lp in output.log_probs)  # the rest sample the whole vocabulary


def test_a_request_the_cache_soft_reset_keeps_all_its_tokens_when_new_weights_interrupt_it(model_path):
    # 40 pages of 16 tokens cannot hold four requests of 37 + 300 tokens: transformers soft resets some,
    # moving their tokens so far into their prompts, before the weights change
    engine = HFEngine(model_path, device="cpu", num_blocks=40, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    params = {"max_new_tokens": 300, "temperature": 1.0, "ignore_eos": True}

    def soft_reset_and_generating() -> bool:
        processor = engine._batcher.batch_processor  # built by the batching thread once it starts
        requests = list(processor.scheduler.active_requests.values()) if processor is not None else []
        return any(state._true_initial_tokens and state.generated_tokens for state in requests)

    async def scenario():
        tasks = [asyncio.create_task(engine.generate(PROMPT[i:], params, f"reset-{i}")) for i in range(4)]
        deadline = asyncio.get_running_loop().time() + 60
        while not soft_reset_and_generating():
            assert asyncio.get_running_loop().time() < deadline, "no request was soft reset: shrink num_blocks"
            assert not all(task.done() for task in tasks), (
                "the requests ended before a soft reset: raise max_new_tokens"
            )
            await asyncio.sleep(0.002)
        await engine.update_weights({name: tensor + 0.05 for name, tensor in model.state_dict().items()})
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

    try:
        outputs = run(scenario())
    finally:
        run(engine.shutdown())
    interrupted = [(i, output) for i, output in enumerate(outputs) if output.finish_reason == "interrupted"]
    assert interrupted
    for i, output in interrupted:  # the old weights' tokens, each with its own logprob: nothing dropped or shifted
        assert len(output.token_ids) == len(output.log_probs) > 0
        reference = teacher_forced_logprobs(model, PROMPT[i:], output.token_ids)
        assert torch.allclose(torch.tensor(output.log_probs), reference, atol=LOGPROB_TOLERANCE)
