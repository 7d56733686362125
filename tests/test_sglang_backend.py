"""The sglang backend's client against a real server speaking SGLang's HTTP contract: our own hf server."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import ray

from agentloop import AgentLoopManager
from agentloop.server.adapters import PackedAdapter
from agentloop.server.sglang_engine import ADAPTER_NAME, SGLangEngine, launch_args
from agentloop.server.collective import WeightGroup, WeightReceiver, WeightSource
from agentloop.server.sglang_requests import (
    build_generate_request,
    init_weights_group_request,
    load_adapter_request,
    unload_adapter_request,
    weights_from_distributed_request,
)
from agentloop.settings import rollout_settings
from tests.support.config import small_config
from tests.support.sglang_contract import (
    load_api_types,
    parse_lora_flags,
    route_request_fields,
    run_sglang_group_member,
)
from tests.test_hf_engine import teacher_forced_logprobs
from tests.test_lora import LORA, random_adapter

PROMPT = [1, 294, 207, 664, 2, 207, 1, 299, 207]
api_types = load_api_types()


@pytest.fixture(scope="module")
def hf_manager(local_ray):
    manager = AgentLoopManager(small_config("actor_rollout_ref.rollout.http.api_key=k"))
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def client(hf_manager):
    return SGLangEngine(
        hf_manager.config.actor_rollout_ref.model.path,
        url=hf_manager.server_addresses[0],
        api_key="k",
        startup_timeout_s=60,
    )


@pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")
def test_requests_validate_against_sglangs_schema():
    for params in (
        {},
        {"temperature": 0.0, "stop_token_ids": [2]},
        {"top_k": 5, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": True},
    ):
        request = build_generate_request(PROMPT, params, "rid-1")
        api_types.GenerateRequest.from_json_value(request)
        api_types.SamplingParams.from_json_value(request["sampling_params"])  # unknown keys would raise here
    with pytest.raises(api_types.JsonContractError):
        api_types.SamplingParams.from_json_value({"max_new_tokens": 4, "not_a_key": 1})


@pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")
def test_lora_requests_and_launch_flags_validate_against_the_wheel():
    request = build_generate_request(PROMPT, {}, "rid-1", lora_name=ADAPTER_NAME)
    assert api_types.GenerateRequest.from_json_value(request).lora_path == ADAPTER_NAME
    for route, body in (
        ("/load_lora_adapter", load_adapter_request(ADAPTER_NAME, "/dev/shm/adapter")),
        ("/unload_lora_adapter", unload_adapter_request(ADAPTER_NAME)),
    ):
        required, optional = route_request_fields(route)
        assert required <= set(body) <= required | optional, (route, body, required, optional)

    def lora_flags(*overrides: str) -> list[str]:
        flags = launch_args(rollout_settings(small_config(*LORA, *overrides)).servers, rank=0)
        return flags[flags.index("--enable-lora") : flags.index("--max-loras-per-batch") + 2]

    parsed = parse_lora_flags(lora_flags())  # target_modules: all-linear, a pattern only the model resolves
    assert parsed["enable_lora"] and parsed["max_lora_rank"] == 4 and parsed["lora_target_modules"] == ["all"]
    parsed = parse_lora_flags(lora_flags("actor_rollout_ref.model.target_modules=[v_proj,q_proj]"))
    assert parsed["lora_target_modules"] == ["q_proj", "v_proj"] and parsed["max_loras_per_batch"] == 2
    with pytest.raises(ValueError, match="invalid choice: 'c_attn'"):
        parse_lora_flags(lora_flags("actor_rollout_ref.model.target_modules=[c_attn]"))
    assert "--enable-lora" not in launch_args(rollout_settings(small_config()).servers, rank=0)


def test_generate_logprobs_and_finish_reasons(client, hf_manager):
    async def scenario():
        sampled = await client.generate(PROMPT, {"max_new_tokens": 6, "ignore_eos": True}, "c1")
        greedy = await client.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, "c2")
        stopped = await client.generate(
            PROMPT, {"max_new_tokens": 6, "temperature": 0.0, "stop_token_ids": [greedy.token_ids[1]]}, "c3"
        )
        return sampled, greedy, stopped

    sampled, greedy, stopped = asyncio.run(scenario())
    assert sampled.finish_reason == "length" and len(sampled.token_ids) == len(sampled.log_probs) == 6
    model = AutoModelForCausalLM.from_pretrained(hf_manager.config.actor_rollout_ref.model.path)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + sampled.token_ids])).logits[0]
    reference = torch.log_softmax(logits, -1)[len(PROMPT) - 1 : -1].gather(
        -1, torch.tensor(sampled.token_ids)[:, None]
    )[:, 0]
    assert torch.allclose(torch.tensor(sampled.log_probs), reference, atol=1e-4)
    assert (
        stopped.finish_reason == "stop"
        and stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(greedy.token_ids[1]) + 1]
    )


async def long_request_in_flight(client, server, session: str) -> asyncio.Task:
    """A 4000-token request, once the engine has it."""
    task = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 4000, "ignore_eos": True}, session))
    deadline = time.monotonic() + 30
    while await server.in_flight.remote() == 0:
        assert time.monotonic() < deadline, "the request never reached the engine"
        await asyncio.sleep(0.05)
    return task


def test_abort(client, hf_manager):
    server = hf_manager.servers[0]

    async def scenario():
        # abort once the request is in the engine (an abort that arrives first finds nothing to abort)
        task = await long_request_in_flight(client, server, "long")
        await client.abort("long")
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(scenario()).finish_reason == "abort"


def test_a_weight_update_pauses_generation_and_interrupts_requests_in_flight(client, hf_manager):
    server, path = hf_manager.servers[0], hf_manager.config.actor_rollout_ref.model.path
    short = {"max_new_tokens": 4, "ignore_eos": True}

    async def scenario():
        task = await long_request_in_flight(client, server, "pushed")
        await client.update_weights_from_disk(path)
        interrupted = await asyncio.wait_for(task, 30)
        # while paused, a new request waits for /continue_generation
        await client._post("/pause_generation", {"mode": "in_place"})
        waiting = asyncio.create_task(client.generate(PROMPT, short, "held"))
        await asyncio.sleep(0.5)
        held = not waiting.done()
        await client._post("/continue_generation", {})
        return interrupted, held, await asyncio.wait_for(waiting, 30)

    interrupted, held, after = asyncio.run(scenario())
    assert interrupted.finish_reason == "interrupted"  # SGLang's abort, which the router continues
    assert held and after.finish_reason == "length" and len(after.token_ids) == 4


def test_weight_update_from_disk_and_memory_release(client, hf_manager, tmp_path):
    path = hf_manager.config.actor_rollout_ref.model.path
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    before = asyncio.run(client.generate(PROMPT, greedy, "w0")).token_ids
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    model.save_pretrained(tmp_path / "perturbed")
    asyncio.run(client.update_weights_from_disk(str(tmp_path / "perturbed")))
    assert asyncio.run(client.generate(PROMPT, greedy, "w1")).token_ids != before

    asyncio.run(client.sleep())
    with pytest.raises(RuntimeError, match="asleep"):
        asyncio.run(client.generate(PROMPT, greedy, "w2"))
    asyncio.run(client.wake_up())
    asyncio.run(client.update_weights_from_disk(path))
    assert asyncio.run(client.generate(PROMPT, greedy, "w3")).token_ids == before


def test_lora_pushes_load_each_adapter_by_name_and_unload_the_previous(client, hf_manager, tmp_path):
    path = hf_manager.config.actor_rollout_ref.model.path
    pushing = SGLangEngine(path, url=hf_manager.server_addresses[0], api_key="k", weights_dir=str(tmp_path))
    params = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    adapters = [random_adapter(path, seed) for seed in (1, 2)]

    async def scenario():
        base = await client.generate(PROMPT, greedy, "base")
        served = []
        for index, (adapter, _) in enumerate(adapters):
            assert await pushing.update_adapter(adapter) == len(adapter.scalings)
            served.append(await pushing.generate(PROMPT, params, f"lora-{index}"))
        with pytest.raises(RuntimeError, match="answered 400: .*name it in lora_path"):
            await client.generate(PROMPT, greedy, "unnamed")  # no lora_path: the base, which this server cannot serve
        left = sorted(entry.name for entry in tmp_path.iterdir())
        await pushing._post("/unload_lora_adapter", unload_adapter_request(ADAPTER_NAME))
        await pushing.shutdown()
        return base, served, left, await client.generate(PROMPT, greedy, "base-again")

    base, served, left, after = asyncio.run(scenario())
    for output, (_, model) in zip(served, adapters):
        reference = teacher_forced_logprobs(model, PROMPT, output.token_ids)
        assert torch.allclose(torch.tensor(output.log_probs), reference, atol=1e-4)
    assert len(left) == 1 and left[0].startswith("agentloop-lora-")  # the first adapter's directory is gone
    assert not list(tmp_path.iterdir())  # and the last one's once the engine shut down
    assert after.token_ids == base.token_ids  # unloaded: the base model again


def test_an_adapter_directory_round_trips_through_peft_format(model_path, tmp_path):
    adapter, _ = random_adapter(model_path, 3)
    loaded = PackedAdapter.load(adapter.save(tmp_path / "adapter"))
    assert loaded.scalings == adapter.scalings and loaded.config == adapter.config
    assert all(torch.equal(loaded.weights.tensors()[name], value) for name, value in adapter.weights.tensors().items())


def test_launch_failure_reports_the_log_tail(tmp_path):
    # The sglang wheel here has no GPU dependencies, so its server dies at start-up: the error says so.
    with pytest.raises((RuntimeError, TimeoutError), match="log tail"):
        SGLangEngine(str(tmp_path), port=30555, startup_timeout_s=60)


@pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")
def test_distributed_weight_requests_validate_against_the_wheel():
    slots = [("model.embed_tokens.weight", "float32", (64, 16)), ("model.norm.weight", "bfloat16", (16,))]
    for route, body in (
        ("/init_weights_update_group", init_weights_group_request("10.0.0.1", 29500, 1, 3, "g", "nccl")),
        ("/update_weights_from_distributed", weights_from_distributed_request(slots, "g", 7)),
        ("/update_weights_from_distributed", weights_from_distributed_request(slots, "g", None)),
        ("/destroy_weights_update_group", {"group_name": "g"}),
    ):
        required, optional = route_request_fields(route)
        assert required <= body.keys() <= required | optional, (route, body.keys(), required, optional)


@pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")
def test_sglangs_own_group_code_joins_our_push_and_receives_every_tensor(tmp_path):
    # the wheel's init_custom_process_group (behind /init_weights_update_group) forms the group with our source over
    # real gloo, and receives tensor by tensor as its /update_weights_from_distributed does
    state = {"a": torch.randn(3, 5), "b": torch.randn(4).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3)}
    source = WeightSource()
    source.keep_weights(state)
    _, port = source.open_weight_group(0, 30)
    group = WeightGroup("127.0.0.1", port, (0,), 1 << 20, 30, name="agentloop-weights-test", wire="tensors")
    gathered = threading.Thread(target=WeightReceiver(group, 0).gather)  # the server actor's part
    gathered.start()
    slots = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state.items()]
    member = run_sglang_group_member("127.0.0.1", port, 2, 1, group.name, slots, str(tmp_path / "received.pt"))
    try:
        sent = source.broadcast_weights(group)
        assert member.wait(timeout=60) == 0, member.stderr.read()
    finally:
        member.kill()
    gathered.join(timeout=30)
    received = torch.load(tmp_path / "received.pt")
    assert sent == sum(t.numel() * t.element_size() for t in state.values())
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


def test_a_collective_push_reaches_sglang_through_its_distributed_routes(client, hf_manager, model_path):
    # rollout.name=sglang attached to our hf server, which speaks SGLang's distributed routes: the server joins the
    # push's gloo group over HTTP, receives tensor by tensor, and serves the pushed policy under its version
    from tests.test_weight_sync import Source, hf_greedy
    from tests.test_supervision import GREEDY, PROMPT as PROBE, perturbed

    manager = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.name=sglang",
            f"actor_rollout_ref.rollout.sglang.urls=[{hf_manager.server_addresses[0]}]",
            "actor_rollout_ref.rollout.sglang.api_key=k",
            "actor_rollout_ref.rollout.weight_sync=collective",
            "actor_rollout_ref.rollout.weight_sync_timeout_s=60",
            "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=0.05",
        )
    )
    try:
        state = perturbed(model_path, 4)
        manager.update_weights_collective(Source.remote(state), version=6)
        output = ray.get(hf_manager.servers[0].generate.remote(PROBE, GREEDY, "probe"), timeout=120)
        assert (output.token_ids, output.policy_version) == (hf_greedy(model_path, state), 6)
        served = asyncio.run(client.generate(PROBE, GREEDY, "through-sglang"))
        assert served.token_ids == output.token_ids
    finally:
        manager.shutdown()
        asyncio.run(client.update_weights_from_disk(model_path))  # the module's other tests expect the base model
