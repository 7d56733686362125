"""Partial rollouts on real Ray and the real hf engine: new weights pushed while trajectories are being
generated interrupt them; each continues from the tokens it has under the new weights, and every token
keeps the log-prob and the policy version of the weights that sampled it."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agentloop.testing  # noqa: F401  (registers fixed_length)
from agentloop import AgentLoopManager
from tests.support.config import small_config

LENGTH = 600


def teacher_forced_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.fixture(scope="module")
def manager(local_ray):
    manager = AgentLoopManager(small_config(f"data.max_response_length={LENGTH}", "actor_rollout_ref.rollout.hf.num_blocks=512"))
    yield manager
    manager.shutdown()


def perturbed(model_path: str, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def wait_until_generating(manager: AgentLoopManager, requests: int, worker: threading.Thread) -> None:
    deadline = time.monotonic() + 60
    while ray.get(manager.servers[0].in_flight.remote()) < requests and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a few dozen tokens into each request
    assert worker.is_alive(), "the requests ended before the push: raise LENGTH"


def test_a_push_mid_rollout_continues_each_trajectory_under_the_new_weights(manager, model_path):
    old = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    new = perturbed(model_path, seed=0)
    rows = [{"prompt": [{"role": "user", "content": f"count {i}"}], "agent_name": "fixed_length", "extra_info": {"length": LENGTH}}
            for i in range(4)]
    result = {}
    rollout = threading.Thread(target=lambda: result.setdefault("batch", manager.generate_sequences(rows)))
    rollout.start()
    wait_until_generating(manager, len(rows), rollout)
    manager.update_weights(new.state_dict(), version=1)
    rollout.join(timeout=120)
    batch = result["batch"]

    assert batch.meta_info["rollout/interrupted_requests"] >= 1
    tensors = batch.batch
    width = tensors["prompts"].shape[1]
    mixed = 0
    for i in range(len(batch)):
        versions = tensors["rollout_policy_versions"][i]
        assert (tensors["response_mask"][i] == 1).all() and (versions >= 0).all()  # LENGTH model tokens, each stamped
        switch = int((versions == 0).sum())
        assert versions.tolist() == [0] * switch + [1] * (LENGTH - switch)  # the old policy's tokens, then the new one's
        mixed += 0 < switch < LENGTH
        prompt = tensors["prompts"][i][tensors["attention_mask"][i, :width].bool()].tolist()
        response = tensors["responses"][i].tolist()
        # each token's rollout log-prob is the log-prob of the weights that sampled it
        expected = torch.where(versions == 0, teacher_forced_log_probs(old, prompt, response), teacher_forced_log_probs(new, prompt, response))
        assert tensors["rollout_log_probs"][i] == pytest.approx(expected, abs=2e-4)
    assert mixed >= 1, "no trajectory was interrupted mid-way"


def test_a_chat_completion_cut_by_new_weights_is_continued_not_returned_cut_off(manager, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": LENGTH, "logprobs": True}
    result = {}
    chat = threading.Thread(
        target=lambda: result.update(requests.post(manager.server_addresses[0] + "/v1/chat/completions", json=body, timeout=120).json())
    )
    chat.start()
    wait_until_generating(manager, 1, chat)
    manager.update_weights(perturbed(model_path, seed=1).state_dict(), version=2)
    chat.join(timeout=120)
    choice = result["choices"][0]
    tokens = choice["logprobs"]["content"]
    # it ran on under the new weights to its budget or its end-of-sequence token, not to where the push cut it
    assert len(tokens) == result["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert len(tokens) == LENGTH
    else:
        assert choice["finish_reason"] == "stop" and tokens[-1]["token"] == tokenizer.eos_token, choice
