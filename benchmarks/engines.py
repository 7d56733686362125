"""``hf`` against ``vllm`` on the same model and workload, one engine at a time, in one run: start-up, time to first
token, generation throughput and seconds per weight update.

    AGENTLOOP_VLLM_PYTHON=$(python -m agentloop.server.vllm_env) python -m benchmarks.engines \\
        [--model PATH] [--requests 64] [--new-tokens 128] [--updates 5]

``--model`` defaults to the tiny model. Throughput: ``--requests`` concurrent requests of ~200 prompt tokens each
generating ``--new-tokens`` (end of sequence ignored). Time to first token: one 200-token prompt, one new token, on
an idle engine (median of 5). A weight update pushes the model's own weights with nothing in flight (median).
Each engine gets the same number of CPU threads (``--threads``, default: the machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any, Awaitable, Callable

import torch
from transformers import AutoModelForCausalLM

from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.server.hf_engine import HFEngine
from agentloop.server.vllm_engine import VLLMEngine, launch_args, server_env
from agentloop.config import compose_config
from agentloop.settings import rollout_settings


def build(name: str, model: str, threads: int) -> Any:
    if name == "hf":
        torch.set_num_threads(threads)
        return HFEngine(model, device="cpu", num_blocks=4096, seed=0)
    config = compose_config(
        [
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.vllm.python={os.environ['AGENTLOOP_VLLM_PYTHON']}",
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.rollout.resources_per_server.CPU={threads}",
            "data.max_prompt_length=1024",
            "data.max_response_length=512",
            "actor_rollout_ref.rollout.vllm.cpu_kvcache_space_gb=2",
        ]
    )
    settings = rollout_settings(config).servers
    return VLLMEngine(
        model,
        python=settings.vllm.python,
        launch_args=launch_args(settings, 0),
        env=server_env(settings),
        startup_timeout_s=600,
    )


def timed(make: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    asyncio.run(make())
    return time.perf_counter() - start


def measure(name: str, model: str, requests: int, new_tokens: int, updates: int, threads: int) -> dict[str, Any]:
    start = time.perf_counter()
    engine = build(name, model, threads)
    row: dict[str, Any] = {"engine": name, "start_up_s": time.perf_counter() - start}
    prompts = [[3 + (i * 7 + j) % 900 for j in range(200)] for i in range(requests)]
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def burst() -> None:
        await asyncio.gather(*(engine.generate(p, params, f"b{i}") for i, p in enumerate(prompts)))

    timed(burst)  # warm-up
    row["tokens_per_s"] = requests * new_tokens / timed(burst)
    first = [timed(lambda i=i: engine.generate(prompts[i], {"max_new_tokens": 1}, f"t{i}")) for i in range(5)]
    row["first_token_s"] = statistics.median(first)
    weights = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    row["update_s"] = statistics.median(timed(lambda: engine.update_weights(weights)) for _ in range(updates))
    asyncio.run(engine.shutdown())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    model = args.model or tiny_model_path()
    rows = [measure(name, model, args.requests, args.new_tokens, args.updates, args.threads) for name in ("hf", "vllm")]
    print(f"model {model}, {args.requests} requests x {args.new_tokens} new tokens, {args.threads} threads")
    print(f"{'engine':8}{'start-up s':>12}{'tokens/s':>10}{'first token s':>15}{'update s':>10}")
    for row in rows:
        print(
            f"{row['engine']:8}{row['start_up_s']:12.1f}{row['tokens_per_s']:10.0f}{row['first_token_s']:15.4f}{row['update_s']:10.4f}"
        )
    hf, vllm = rows
    print(
        f"vllm / hf: tokens/s {vllm['tokens_per_s'] / hf['tokens_per_s']:.2f}x, first token "
        f"{vllm['first_token_s'] / hf['first_token_s']:.2f}x, update {vllm['update_s'] / hf['update_s']:.2f}x, "
        f"start-up {vllm['start_up_s'] / hf['start_up_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
