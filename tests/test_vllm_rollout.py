"""``rollout.name=vllm`` through the whole rollout stack on Ray: batches with the engine's exact ids and logprobs,
weight pushes through the manager, partial rollouts (a push mid-rollout: each trajectory continues under the new
weights, every token keeping its policy's log-prob and version), a dead server replaced (its vLLM process
stopped with it) serving the latest weights, a collective push in buckets; the session gateway over a vLLM server,
and a judge served by vLLM."""

from __future__ import annotations

import time

import psutil
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agentloop.testing  # noqa: F401  (registers fixed_length)
from agentloop import AgentLoopManager
from agentloop.dumps import mask_runs
from agentloop.server.rollout_server import RolloutServer
from tests.support.config import small_config
from tests.support.models import SCRIPTS
from tests.test_judge import judge_answers as judge_answers  # noqa: F401  (a fixture)
from tests.test_partial_rollouts import LENGTH, ROWS, check_tokens_of_two_policies, perturbed, pushed_mid_flight
from tests.test_vllm_engine import assert_logprobs_match, vllm_overrides
from tests.test_weight_sync import BUCKET_MB, Source
from agentloop.settings import rollout_settings

PROMPT = list(range(3, 30))
SAMPLED = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}


def sample(server):
    return ray.get(server.generate.remote(PROMPT, SAMPLED, "probe"), timeout=120)


def vllm_servers() -> list[psutil.Process]:
    """vLLM server processes of this test's Ray (its descendants) and any orphaned under init: not those of another
    suite that may run on the machine."""
    ours = {child.pid for child in psutil.Process().children(recursive=True)}
    return [
        process
        for process in psutil.process_iter(["cmdline", "ppid"])
        if "vllm.entrypoints.openai.api_server" in (process.info["cmdline"] or [])
        and (process.pid in ours or process.info["ppid"] == 1)
    ]


def wait_for_vllm_servers(count: int, timeout_s: float = 60) -> int:
    """How many vLLM server processes run once ``count`` do, or when ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while len(vllm_servers()) != count and time.monotonic() < deadline:
        time.sleep(0.5)
    return len(vllm_servers())


def wait_until_dead(actor, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the killed actor still answered after {timeout_s}s")


@pytest.fixture(scope="module")
def manager(local_ray):
    manager = AgentLoopManager(
        small_config(
            *vllm_overrides(),
            f"data.max_response_length={LENGTH}",
            f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={BUCKET_MB}",
        )
    )
    yield manager
    manager.shutdown()
    assert wait_for_vllm_servers(0) == 0  # each server stops its vLLM process on the way out


def test_a_push_mid_rollout_continues_each_trajectory_under_the_new_weights(manager, model_path):
    old, new = perturbed(model_path, seed=0), perturbed(model_path, seed=1)
    manager.update_weights(old.state_dict(), version=1)
    batch, pushed = pushed_mid_flight(
        manager,
        len(ROWS),
        lambda: manager.generate_sequences(ROWS),
        lambda: manager.update_weights(new.state_dict(), version=2),
    )
    assert pushed, "the rollout ended before the push: raise LENGTH"
    check_tokens_of_two_policies(batch, old, new, versions=(1, 2))


def test_batches_weights_and_a_replaced_server(manager, model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    manager.update_weights(model.state_dict(), version=3)
    batch = manager.generate_sequences(
        [{"prompt": [{"role": "user", "content": f"what is {i} + 1?"}]} for i in range(4)]
    )
    assert len(batch) == 4
    for row in range(4):  # the batch holds the engine's ids and logprobs, exactly
        prompt = batch.batch["prompts"][row][batch.batch["attention_mask"][row, :96].bool()].tolist()
        mask = batch.batch["response_mask"][row].bool()
        response = batch.batch["responses"][row][mask].tolist()
        logprobs = batch.batch["rollout_log_probs"][row][mask].tolist()
        reference = type("Output", (), {"token_ids": response, "log_probs": logprobs})
        assert_logprobs_match(model, prompt, reference)

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    manager.update_weights(model.state_dict(), version=4)
    assert_logprobs_match(model, PROMPT, sample(manager.servers[0]))

    # a dead server is replaced on its rank, its vLLM process gone with it, and serves the latest push
    dead = manager.servers[0]
    ray.kill(dead)
    wait_until_dead(dead)  # ray.kill returns at once: a probe sent now may still be answered, a request not
    batch = manager.generate_sequences([{"prompt": [{"role": "user", "content": "q"}]}])
    assert [(e.rank, e.kind) for e in manager.pool.events] == [(0, "restarted")]
    assert_logprobs_match(model, PROMPT, sample(manager.servers[0]))
    assert wait_for_vllm_servers(1) == 1  # Ray stops a killed actor's child processes, a moment later


def test_a_collective_push_reaches_a_vllm_server(manager, model_path):
    # vLLM's own transfer engines need CUDA: the broadcast (in buckets) ends at the server actor, which loads it
    # through vLLM's weight-transfer API as any push; the served log-probs are the pushed policy's
    model = perturbed(model_path, seed=3)
    manager.update_weights_collective(Source.remote(model.state_dict()), version=5)
    output = sample(manager.servers[0])
    assert output.policy_version == 5
    assert_logprobs_match(model, PROMPT, output)


def test_an_external_agent_through_the_gateway_on_vllm_is_exact(local_ray, scripted_model):
    """The session gateway over a vLLM rollout server, unchanged: an OpenAI-SDK program's calls recorded as one
    segment with the engine's exact tokens, the tool results it sent back as observations."""
    from tests.test_gateway import AGENTS, assert_exact, external
    from tests.test_tool_agent import tool_config

    server = RolloutServer.remote(rollout_settings(tool_config(scripted_model, *vllm_overrides())).servers, 0)
    try:
        ray.get(server.__ray_ready__.remote(), timeout=600)
        tokenizer = AutoTokenizer.from_pretrained(scripted_model.path)
        output = external(server, tokenizer, scripted_model, *vllm_overrides(), function=f"{AGENTS}.scripted_openai")
        assert output.end_reason == "stop" and not output.segments and output.metrics["gateway_calls"] == 3
        texts = [tokenizer.decode(output.response_ids[a:b]) for value, a, b in mask_runs(output.response_mask) if value]
        assert texts == [turn + "<|im_end|>" for turn in SCRIPTS["multi"]]
        assert_exact(AutoModelForCausalLM.from_pretrained(scripted_model.path, dtype=torch.float32), output)
    finally:
        ray.get(server.shutdown.remote(), timeout=120)
        ray.kill(server)


def test_a_generative_judge_served_by_vllm(local_ray, ok_model, coin_model, judge_answers):  # noqa: F811
    """``reward_model.rollout.name=vllm``: the judge's own server runs on vLLM, unchanged; a reward function awaits its
    answers, which are the judge model's greedy replies."""
    from tests.test_judge import JUDGED_SOURCES, RESPONSE_LENGTH, rows

    manager = AgentLoopManager(
        small_config(
            *vllm_overrides(),
            "actor_rollout_ref.rollout.name=hf",  # the policy on hf, the judge on vLLM
            f"actor_rollout_ref.model.path={ok_model}",
            "reward_model.enable=true",
            "reward_model.rollout.name=vllm",
            f"reward_model.model.path={coin_model}",
            f"reward_model.rollout.response_length={RESPONSE_LENGTH}",
            *(f"+custom_reward_function.by_data_source.{name}=tests.support.judges.{name}" for name in JUDGED_SOURCES),
        )
    )
    try:
        batch = manager.generate_sequences(rows("ask_the_judge", 4))
        fields = batch.non_tensor_batch
        for i in range(4):
            assert fields["failure"][i] is None
            assert fields["reward_extra_info"][i]["judge_text"] == judge_answers[i]
            assert fields["reward_score"][i] == float(judge_answers[i].startswith("yes"))
        assert batch.meta_info["judge/calls"] == 4 and batch.meta_info["judge/failures"] == 0
    finally:
        manager.shutdown()
