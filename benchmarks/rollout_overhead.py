"""Rollout-stack overhead: the same requests sent straight to one engine vs. through the whole stack.

    python -m benchmarks.rollout_overhead [--samples 256]

(a) one ``HFEngine`` driven in-process with asyncio; (b) ``AgentLoopManager`` -> workers -> router ->
one ``RolloutServer`` with the same engine settings and CPU threads. Prints tokens/s of both and
b/a (target >= 0.95), then the router's max/mean in-flight imbalance over a mixed-length run across
two servers (target <= 1.15). Figures are ratios within one run; absolute speeds vary by machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import ray
import torch

import agentloop.testing  # noqa: F401  (registers "fixed_length": one turn of exactly extra_info.length tokens)
from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare
from agentloop.server.hf_engine import HFEngine
from agentloop.settings import rollout_settings

THREADS = 2


def make_rows(count: int, seed: int = 0, arrival_gap_s: float = 0.0) -> list[dict[str, Any]]:
    """Prompts of 1-6 phrases, response lengths 8-128 tokens; request i arrives at i * arrival_gap_s."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [{"role": "user", "content": f"request {i}: " + "tell me a number " * rng.randint(1, 6)}],
            "agent_name": "fixed_length",
            "extra_info": {"length": rng.choice([8, 16, 32, 64, 128]), "delay_s": i * arrival_gap_s},
        }
        for i in range(count)
    ]


def config_for(servers: int, cpus_per_server: int):
    return prepare(
        compose_config(
            [
                "data.max_prompt_length=128",
                "data.max_response_length=128",
                f"actor_rollout_ref.rollout.data_parallel_size={servers}",
                f"actor_rollout_ref.rollout.resources_per_server.CPU={cpus_per_server}",
                "actor_rollout_ref.rollout.agent.num_workers=1",
            ]
        )
    )


class DirectEngine:
    """Path (a): the engine in this process, fed pre-rendered prompt ids."""

    def __init__(self, config, rows) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        self.requests = [
            (
                tokenizer.apply_chat_template(
                    row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
                ),
                {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": row["extra_info"]["length"]},
            )
            for row in rows
        ]
        torch.set_num_threads(THREADS)
        self.engine = HFEngine.from_settings(
            rollout_settings(config).servers, rank=0
        )  # the settings a rollout server gets

    def run(self) -> tuple[int, float]:
        async def run_all():
            return await asyncio.gather(
                *(self.engine.generate(ids, params, f"r{i}") for i, (ids, params) in enumerate(self.requests))
            )

        start = time.perf_counter()
        outputs = asyncio.run(run_all())
        return sum(len(output.token_ids) for output in outputs), time.perf_counter() - start


def through_stack(manager: AgentLoopManager, rows) -> tuple[int, float, dict]:
    """Path (b): manager -> workers -> agent loop -> router -> server."""
    start = time.perf_counter()
    batch = manager.generate_sequences(rows)
    elapsed = time.perf_counter() - start
    return int(batch.batch["response_mask"].sum()), elapsed, batch.meta_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = make_rows(args.samples)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)

    direct = DirectEngine(config_for(1, THREADS), rows)
    manager = AgentLoopManager(config_for(1, THREADS))
    try:  # the in-process engine's thread would keep a failed run from exiting
        direct.run(), through_stack(manager, rows)  # warm-up
        # Interleaved repeats, medians: this machine's speed drifts more between runs than the overhead.
        direct_rates, stack_rates = [], []
        for _ in range(args.repeats):
            tokens, seconds = direct.run()
            direct_rates.append(tokens / seconds)
            stack_tokens, seconds, _ = through_stack(manager, rows)
            assert stack_tokens == tokens, (stack_tokens, tokens)
            stack_rates.append(stack_tokens / seconds)
    finally:
        manager.shutdown()
        asyncio.run(direct.engine.shutdown())
    direct_rate, stack_rate = statistics.median(direct_rates), statistics.median(stack_rates)
    print(f"samples: {len(rows)}, generated tokens per run: {tokens}, repeats: {args.repeats}")
    print(f"(a) engine in-process: {direct_rate:9.1f} tokens/s (median)")
    print(f"(b) through the stack: {stack_rate:9.1f} tokens/s (median)")
    print(f"ratio b/a: {stack_rate / direct_rate:.3f} (target >= 0.95)")

    manager = AgentLoopManager(config_for(2, 1))
    # Staggered arrivals so that completions and new dispatches interleave, as in a real rollout.
    _, _, meta = through_stack(manager, make_rows(args.samples, seed=1, arrival_gap_s=0.01))
    manager.shutdown()
    print(
        f"two servers, mixed lengths, staggered arrivals: requests per server {meta['rollout/requests_per_server']}, "
        f"in-flight max/mean {meta['rollout/in_flight_imbalance']:.3f} (target <= 1.15)"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
