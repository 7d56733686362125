"""Partial rollouts on real Ray and the real hf engine: new weights pushed while trajectories are being
generated interrupt them; each continues from the tokens it has under the new weights, and every token
keeps the log-prob and the policy version of the weights that sampled it."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

import agentloop.testing  # noqa: F401  (registers fixed_length)
from agentloop import AgentLoopManager
from tests.support.config import small_config

LENGTH = 600


def teacher_forced_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_a_push_mid_rollout_continues_each_trajectory_under_the_new_weights(local_ray, model_path):
    manager = AgentLoopManager(small_config(f"data.max_response_length={LENGTH}", "actor_rollout_ref.rollout.hf.num_blocks=512"))
    try:
        old = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        new = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            for parameter in new.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        rows = [{"prompt": [{"role": "user", "content": f"count {i}"}], "agent_name": "fixed_length", "extra_info": {"length": LENGTH}}
                for i in range(4)]
        result = {}
        rollout = threading.Thread(target=lambda: result.setdefault("batch", manager.generate_sequences(rows)))
        rollout.start()
        server = manager.servers[0]
        deadline = time.monotonic() + 60
        while ray.get(server.in_flight.remote()) < len(rows) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a few dozen tokens into each trajectory
        assert rollout.is_alive(), "the rollout ended before the push: raise LENGTH"
        manager.update_weights(new.state_dict(), version=1)
        rollout.join(timeout=120)
        batch = result["batch"]
    finally:
        manager.shutdown()

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
