"""Engine ``vllm`` against a real vLLM server on the tiny model: the contract the ``hf`` engine's tests hold.

vLLM runs in its own environment (``python -m agentloop.server.vllm_env``), named by ``AGENTLOOP_VLLM_PYTHON``;
``.ci/run`` builds it and sets it. Without it these tests skip, except under CI, where they fail.
"""

import asyncio
import os
import re
import signal
import time
from typing import Any, Awaitable, Callable

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from agentloop.server.engine import EngineAsleep
from agentloop.server.launched import live_processes_in_group
from agentloop.server.vllm_engine import VLLMEngine
from tests.test_hf_engine import teacher_forced_logprobs
from tests.support.config import small_config
from agentloop.settings import rollout_settings

PROMPT = list(range(3, 40))
LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides, as for the hf engine


def vllm_overrides() -> list[str]:
    """The config overrides that put the rollout on vLLM here (skip, or fail under CI, without its environment)."""
    python = os.environ.get("AGENTLOOP_VLLM_PYTHON")
    if not python:
        message = "AGENTLOOP_VLLM_PYTHON is not set: build vLLM's environment with python -m agentloop.server.vllm_env"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return [
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.vllm.python={python}",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=32",  # vLLM's CPU attention takes multiples of 32
    ]


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngine.from_settings(
        rollout_settings(small_config(*vllm_overrides(), "data.max_prompt_length=4000")).servers, rank=0
    )
    ENGINES.append(engine)
    yield engine
    run(engine.shutdown())
    ENGINES.remove(engine)


ENGINES: list[VLLMEngine] = []  # whose connection pools each run() closes with its loop


def run(coroutine):
    async def and_close():
        try:
            return await coroutine
        finally:
            for engine in ENGINES:
                await engine.client.close()

    return asyncio.run(and_close())


async def running_in_the_server(engine, request: asyncio.Task, timeout: float = 180.0) -> bool:
    """Until vLLM's scheduler runs ``request`` and has decoded a little (True), or the request ended before its gauge
    showed it (False: too quick to cut, ``cut_short`` runs the scenario again): counting our own calls in flight is
    not enough on a loaded machine, where a request may reach the server only after a pause meant to interrupt it."""
    deadline = asyncio.get_running_loop().time() + timeout
    metrics = ""
    while asyncio.get_running_loop().time() < deadline and not request.done():
        metrics = (await asyncio.to_thread(requests.get, engine.url + "/metrics", timeout=10)).text
        if re.search(r"^vllm:num_requests_running\{[^}]*\} [1-9]", metrics, re.MULTILINE):
            await asyncio.sleep(0.2)
            return True
        await asyncio.sleep(0.05)
    if request.done() and not request.exception():
        return False
    requests_lines = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests")]
    raise AssertionError(
        f"the vLLM server at {engine.url} never reported the request running within {timeout} s "
        f"({f'it failed: {request.exception()!r}' if request.done() else 'still in flight'}); its gauges: "
        f"{requests_lines}"
    )


def cut_short(scenario: Callable[[], Awaitable[Any]]) -> Any:
    """``scenario()``'s output, run again (up to three times) while vLLM finished its long request before the cut
    (an abort, a weight push) reached it: on a quiet machine 3,000 tokens of the tiny model take about a second, and
    such a run tests nothing."""
    for _ in range(3):
        output = run(scenario())
        if output.finish_reason != "length":
            break
    return output


def assert_logprobs_match(model, prompt, output, temperature=1.0):
    reference = teacher_forced_logprobs(model, prompt, output.token_ids, temperature)
    assert torch.allclose(torch.tensor(output.log_probs), reference, atol=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_forward(engine, model_path, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    params = {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True}
    prompts = [PROMPT, PROMPT[:20], PROMPT[5:]]

    async def sample():
        return await asyncio.gather(*(engine.generate(p, params, f"lp-{i}") for i, p in enumerate(prompts)))

    for prompt, output in zip(prompts, run(sample())):
        assert len(output.token_ids) == len(output.log_probs) == 24 and output.finish_reason == "length"
        assert_logprobs_match(model, prompt, output, temperature)


def test_finish_reasons_stop_ids_and_greedy(engine):
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    first = run(engine.generate(PROMPT, greedy, "g1"))
    assert run(engine.generate(PROMPT, greedy, "g2")).token_ids == first.token_ids
    assert first.finish_reason == "length"
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
    run(engine.flush_cache())
    assert run(engine.generate(PROMPT, params, "p1")).cached_tokens == 0
    # block size 32: the first full block of the 37-token prompt is shared
    assert run(engine.generate(PROMPT + [7, 8], params, "p2")).cached_tokens == 32


def test_bad_requests_are_refused_and_the_server_keeps_serving(engine):
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['max_tokens'\]"):
        run(engine.generate(PROMPT, {"max_tokens": 4}, "bad"))
    with pytest.raises(RuntimeError, match="answered 400"):  # an id past the vocabulary: vLLM's own 4xx
        run(engine.generate([5000], {"max_new_tokens": 2}, "bad"))
    with pytest.raises(ValueError, match="text only"):
        run(engine.generate(PROMPT, {"max_new_tokens": 2}, "bad", images=[object()]))
    assert requests.get(engine.url + "/health", timeout=10).status_code == 200
    assert run(engine.generate(PROMPT, {"max_new_tokens": 2}, "after-bad")).token_ids


def test_abort_returns_partial_with_reason(engine):
    async def scenario():
        task = asyncio.create_task(engine.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, "long"))
        if not await running_in_the_server(engine, task):
            return task.result()  # (finished: cut_short runs it again)
        assert await engine.abort("long") == 1
        return await asyncio.wait_for(task, timeout=30)

    output = cut_short(scenario)
    assert output.finish_reason == "abort"
    assert 0 < len(output.token_ids) == len(output.log_probs) < 3000
    assert engine.num_in_flight == 0


def test_weights_update_with_requests_in_flight_and_from_disk(engine, model_path, tmp_path):
    original = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():  # the tied output head moves with the embeddings
            parameter.add_(0.05 * torch.randn_like(parameter))
    perturbed = model.state_dict()  # a tied model's: the embeddings and the output head share memory

    async def update_during_a_request():
        long = asyncio.create_task(engine.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, "long-w"))
        if not await running_in_the_server(engine, long):
            return long.result()  # (finished: cut_short runs it again)
        assert await engine.update_weights(perturbed) == len(perturbed)
        return await asyncio.wait_for(long, timeout=30)

    interrupted = cut_short(update_during_a_request)
    assert interrupted.finish_reason == "interrupted"  # its tokens so far, for the router to continue
    assert 0 < len(interrupted.token_ids) == len(interrupted.log_probs) < 3000
    # the new weights serve, exactly: a continuation of the interrupted request included
    prompt = PROMPT + interrupted.token_ids
    continued = run(engine.generate(prompt, {"max_new_tokens": 16, "ignore_eos": True}, "c"))
    assert_logprobs_match(model, prompt, continued)
    under_old_weights = teacher_forced_logprobs(original, prompt, continued.token_ids)
    assert not torch.allclose(torch.tensor(continued.log_probs), under_old_weights, atol=1e-2)

    original.save_pretrained(tmp_path)
    run(engine.update_weights_from_disk(str(tmp_path)))
    assert_logprobs_match(original, PROMPT, run(engine.generate(PROMPT, {"max_new_tokens": 16}, "back")))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        run(engine.update_weights_from_disk(str(tmp_path / "missing")))


def test_sleep_and_wake_up_keep_the_weights(engine):
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    before = run(engine.generate(PROMPT, greedy, "s0")).token_ids
    run(engine.sleep())
    assert engine.is_sleeping
    with pytest.raises(EngineAsleep):
        run(engine.generate(PROMPT, greedy, "s1"))
    run(engine.wake_up())
    assert run(engine.generate(PROMPT, greedy, "s2")).token_ids == before


def test_a_missing_vllm_is_named_with_the_fix(model_path):
    with pytest.raises(RuntimeError, match="vLLM is not installed for .*python -m agentloop.server.vllm_env"):
        VLLMEngine(model_path, python=os.path.realpath(os.sys.executable))


def test_a_server_that_dies_at_start_up_reports_its_log(tmp_path):
    python = vllm_overrides()[1].split("=", 1)[1]
    with pytest.raises(RuntimeError, match="exited with code .* log tail"):
        VLLMEngine(str(tmp_path), python=python, startup_timeout_s=300)


def test_an_attached_engine_drives_a_running_server_and_leaves_it_running(engine, model_path):
    attached = VLLMEngine(model_path, url=engine.url + "/", startup_timeout_s=60)
    ENGINES.append(attached)
    try:
        greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        assert (
            run(attached.generate(PROMPT, greedy, "at")).token_ids
            == run(engine.generate(PROMPT, greedy, "own")).token_ids
        )
        run(attached.shutdown())
        assert engine.server.process.poll() is None and run(engine.generate(PROMPT, greedy, "still")).token_ids
    finally:
        ENGINES.remove(attached)


def test_a_killed_server_fails_its_calls_without_hanging(engine):
    # (the module's server, so this test comes last)
    assert run(engine.generate(PROMPT, {"max_new_tokens": 2}, "k0")).token_ids
    group = live_processes_in_group(engine.server.process.pid)
    assert len(group) >= 2  # the API server and vLLM's engine core
    os.kill(engine.server.process.pid, signal.SIGKILL)  # the API server alone, as when its launcher is killed
    engine.server.process.wait(timeout=30)
    with pytest.raises(Exception):
        run(asyncio.wait_for(engine.generate(PROMPT, {"max_new_tokens": 2}, "k1"), timeout=60))
    deadline = time.monotonic() + 60
    while live_processes_in_group(engine.server.process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not live_processes_in_group(engine.server.process.pid), "vLLM's engine core outlived its API server"
