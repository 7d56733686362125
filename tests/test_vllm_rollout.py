"""``rollout.name=vllm`` through the whole rollout stack on Ray: batches with the engine's exact ids and logprobs,
weight pushes through the manager, and a dead server replaced (its vLLM process stopped with it) serving the latest
weights."""

from __future__ import annotations

import psutil
import ray
import torch
from transformers import AutoModelForCausalLM

from agentloop import AgentLoopManager
from tests.support.config import small_config
from tests.test_vllm_engine import assert_logprobs_match, vllm_overrides

PROMPT = list(range(3, 30))
SAMPLED = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}


def sample(server):
    return ray.get(server.generate.remote(PROMPT, SAMPLED, "probe"), timeout=120)


def vllm_servers() -> list[psutil.Process]:
    return [
        p for p in psutil.process_iter(["cmdline"]) if "vllm.entrypoints.openai.api_server" in (p.info["cmdline"] or [])
    ]


def test_batches_weights_and_a_replaced_server(local_ray, model_path):
    manager = AgentLoopManager(small_config(*vllm_overrides()))
    try:
        batch = manager.generate_sequences(
            [{"prompt": [{"role": "user", "content": f"what is {i} + 1?"}]} for i in range(4)]
        )
        assert len(batch) == 4
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
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
        manager.update_weights(model.state_dict(), version=1)
        assert_logprobs_match(model, PROMPT, sample(manager.servers[0]))

        # a dead server is replaced on its rank, its vLLM process gone with it, and serves the latest push
        dead = manager.servers[0]
        ray.kill(dead)
        batch = manager.generate_sequences([{"prompt": [{"role": "user", "content": "q"}]}])
        assert [(e.rank, e.kind) for e in manager.pool.events] == [(0, "restarted")]
        assert_logprobs_match(model, PROMPT, sample(manager.servers[0]))
        assert len(vllm_servers()) == 1
    finally:
        manager.shutdown()
    assert not vllm_servers()
