"""Partial rollouts on real Ray and the real hf engine: new weights pushed while trajectories are being
generated interrupt them; each continues from the tokens it has under the new weights, and every token
keeps the log-prob and the policy version of the weights that sampled it. The same through the sglang
backend, attached to the hf server, which speaks SGLang's HTTP API; and for an OpenAI chat completion."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import ray
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agentloop.testing  # noqa: F401  (registers fixed_length and discarded_turn)
from agentloop import AgentLoopManager
from agentloop.batch import RolloutBatch
from tests.support.config import small_config

LENGTH = 600
ROWS = [
    {
        "prompt": [{"role": "user", "content": f"count {i}"}],
        "agent_name": "fixed_length",
        "extra_info": {"length": LENGTH},
    }
    for i in range(2)
]


@pytest.fixture(scope="module")
def manager(local_ray):
    manager = AgentLoopManager(
        small_config(f"data.max_response_length={LENGTH}", "actor_rollout_ref.rollout.hf.num_blocks=512")
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def attached(manager):
    """Rollout servers of the sglang backend driving ``manager``'s server as an SGLang server (attach mode)."""
    attached = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.name=sglang",
            f"actor_rollout_ref.rollout.sglang.urls=[{manager.server_addresses[0]}]",
            "actor_rollout_ref.rollout.n=2",
            f"data.max_response_length={LENGTH}",
        )
    )
    yield attached
    attached.shutdown()


def teacher_forced_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def perturbed(model_path: str, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def pushed_mid_flight(
    manager: AgentLoopManager, requests_in_flight: int, work: Callable[[], Any], push: Callable[[], Any]
) -> tuple[Any, bool]:
    """``work()`` on a thread, ``push()`` once its requests are a few dozen tokens in; ``work``'s result, and
    whether the push came before it ended."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", work()))
    worker.start()
    deadline = time.monotonic() + 60
    while ray.get(manager.servers[0].in_flight.remote()) < requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    pushed = worker.is_alive()
    if pushed:
        push()
    worker.join(timeout=120)
    return result["value"], pushed


def check_tokens_of_two_policies(
    batch: RolloutBatch, old: torch.nn.Module, new: torch.nn.Module, versions: tuple[int, int]
) -> None:
    """Each trajectory: the old policy's tokens, then the new one's, each stamped with its version and carrying
    its own policy's log-prob; at least one trajectory was cut between the two."""
    assert batch.meta_info["rollout/interrupted_requests"] >= 1
    tensors = batch.batch
    width = tensors["prompts"].shape[1]
    mixed = 0
    for i in range(len(batch)):
        stamped = tensors["rollout_policy_versions"][i]
        assert (tensors["response_mask"][i] == 1).all()  # LENGTH model tokens
        switch = int((stamped == versions[0]).sum())
        assert stamped.tolist() == [versions[0]] * switch + [versions[1]] * (LENGTH - switch)
        mixed += 0 < switch < LENGTH
        prompt = tensors["prompts"][i][tensors["attention_mask"][i, :width].bool()].tolist()
        response = tensors["responses"][i].tolist()
        expected = torch.where(
            stamped == versions[0],
            teacher_forced_log_probs(old, prompt, response),
            teacher_forced_log_probs(new, prompt, response),
        )
        assert tensors["rollout_log_probs"][i] == pytest.approx(expected, abs=2e-4)
    assert mixed >= 1, "no trajectory was interrupted mid-way"


@pytest.mark.parametrize("own_request_id", [False, True], ids=["row_request_id", "verl_style_own_request_id"])
def test_a_push_mid_rollout_continues_each_trajectory_under_the_new_weights(manager, model_path, own_request_id):
    # a loop generating under request ids of its own (verl's take uuid4()) gets its tokens' versions all the same
    rows = [{**row, "extra_info": {**row["extra_info"], "own_request_id": own_request_id}} for row in ROWS]
    old, new = perturbed(model_path, seed=0), perturbed(model_path, seed=1)
    manager.update_weights(old.state_dict(), version=1)
    batch, pushed = pushed_mid_flight(
        manager,
        len(ROWS),
        lambda: manager.generate_sequences(rows),
        lambda: manager.update_weights(new.state_dict(), version=2),
    )
    assert pushed, "the rollout ended before the push: raise LENGTH"
    check_tokens_of_two_policies(batch, old, new, versions=(1, 2))


def test_a_turn_taken_back_leaves_no_version_on_the_tokens_kept(manager, model_path):
    # each token's version travels with it: a turn the loop discards (here cut by a push, so of two versions) does
    # not shift its versions onto the turn kept after it, as matching the sample's versions to its tokens by order
    # would
    row = {
        "prompt": [{"role": "user", "content": "count"}],
        "agent_name": "discarded_turn",
        "extra_info": {"length": LENGTH},
    }
    manager.update_weights(perturbed(model_path, seed=0).state_dict(), version=5)
    batch, pushed = pushed_mid_flight(
        manager,
        1,
        lambda: manager.generate_sequences([row]),
        lambda: manager.update_weights(perturbed(model_path, seed=1).state_dict(), version=6),
    )
    discarded = batch.non_tensor_batch["extra_fields"][0]["discarded_versions"]
    assert pushed and 5 in discarded, "the push came after the first turn: raise LENGTH"
    assert batch.batch["rollout_policy_versions"][0].tolist() == [6] * LENGTH


def test_new_weights_mid_rollout_through_the_sglang_backend(manager, attached, model_path, tmp_path):
    # The hf server's /pause_generation (abort mode) returns each request's tokens so far, as SGLang's does; the
    # sglang client reports them interrupted, and the continuations wait for the update and take its version.
    assert attached.server_addresses == manager.server_addresses
    old, new = perturbed(model_path, seed=2), perturbed(model_path, seed=3)
    manager.update_weights(old.state_dict(), version=3)
    new.save_pretrained(tmp_path / "new")

    def push() -> None:
        ray.get(attached.servers[0].update_weights_from_disk.remote(str(tmp_path / "new"), 1), timeout=60)

    batch, pushed = pushed_mid_flight(attached, 2 * len(ROWS), lambda: attached.generate_sequences(ROWS), push)
    assert pushed, "the rollout ended before the update: raise LENGTH"
    assert len(batch) == 2 * len(ROWS)  # rollout.n=2
    check_tokens_of_two_policies(batch, old, new, versions=(0, 1))


def test_a_chat_completion_cut_by_new_weights_is_continued_not_returned_cut_off(manager, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": LENGTH, "logprobs": True}
    url = manager.server_addresses[0] + "/v1/chat/completions"
    new = perturbed(model_path, seed=4)
    for _ in range(5):  # the model may end a reply on its own before the push: ask again
        result, pushed = pushed_mid_flight(
            manager,
            1,
            lambda: requests.post(url, json=body, timeout=120).json(),
            lambda: manager.update_weights(new.state_dict(), version=4),
        )
        if pushed:
            break
    assert pushed, "every reply ended before the push"
    choice = result["choices"][0]
    tokens = choice["logprobs"]["content"]
    # SGLang's report of the weights per token span: the push's version ends the reply, contiguous spans cover it
    spans, last = result["metadata"]["weight_versions"], result["metadata"]["weight_version"]
    assert last == spans[-1]["version"] == "4" and len(spans) <= 2
    assert [span["start"] for span in spans] == [0] + [span["end"] for span in spans[:-1]] and spans[-1]["end"] == len(
        tokens
    )
    # it ran on under the new weights to its budget or its end-of-sequence token, not to where the push cut it
    assert len(tokens) == result["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert len(tokens) == LENGTH
    else:
        assert choice["finish_reason"] == "stop" and tokens[-1]["token"] == tokenizer.eos_token, choice
