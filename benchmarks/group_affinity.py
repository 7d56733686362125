"""GRPO group affinity in the router: prompt tokens taken from the prefix cache on first turns, with and without.

    python -m benchmarks.group_affinity [--rows 8] [--n 8] [--repeats 3] [--engine hf|vllm] [KEY=VALUE ...]

Two rollout servers (``data_parallel_size=2``), ``--rows`` prompts of about 300 words (~400 tokens) each sampled
``--n`` times, one 8-token turn per sample: every prompt token is a first-turn token. Runs alternate
affinity off (``rollout.agent.group_affinity_slack=null``: least-in-flight only) and on (the default),
each on freshly flushed caches, and print ``rollout/cached_token_share``, the prompt tokens prefilled
(not taken from a cache) and the rollout's wall time.

``--engine vllm``: vLLM servers under ``--vllm-python`` (default ``$AGENTLOOP_VLLM_PYTHON``; built by
``python -m agentloop.server.vllm_env``) with ``engine_kwargs.vllm.block_size=32`` (vLLM's CPU attention takes
multiples of 32). Any ``KEY=VALUE`` arguments are further config overrides.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import ray

import agentloop.testing  # noqa: F401  (registers fixed_length)
from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare


def engine_overrides(engine: str, vllm_python: str | None) -> list[str]:
    """The config overrides that select ``engine`` (hf: none)."""
    if engine == "hf":
        return []
    if not vllm_python:
        raise SystemExit("--engine vllm needs --vllm-python or $AGENTLOOP_VLLM_PYTHON")
    return [
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.vllm.python={vllm_python}",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=32",
    ]


def rollout(slack: str, rows: list[dict], n: int, overrides: list[str]) -> tuple[float, float, float]:
    manager = AgentLoopManager(
        prepare(
            compose_config(
                [
                    "actor_rollout_ref.rollout.data_parallel_size=2",
                    f"actor_rollout_ref.rollout.n={n}",
                    f"actor_rollout_ref.rollout.agent.group_affinity_slack={slack}",
                    "data.max_prompt_length=512",
                    *overrides,
                ]
            )
        )
    )
    try:
        # warm-up (compiled kernels, allocated caches) on the measured rows: with affinity on, one row's samples would
        # all go to one server and leave the other cold, its first-call costs in the measured wall time
        manager.generate_sequences(rows)
        ray.get([server.flush_cache.remote() for server in manager.servers])
        start = time.perf_counter()
        batch = manager.generate_sequences(rows)
        wall = time.perf_counter() - start
    finally:
        manager.shutdown()
    prompt_tokens = float(batch.batch["attention_mask"][:, : batch.batch["prompts"].shape[1]].sum())
    share = batch.meta_info["rollout/cached_token_share"]
    return share, prompt_tokens * (1 - share), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--vllm-python", default=os.environ.get("AGENTLOOP_VLLM_PYTHON"))
    parser.add_argument("overrides", nargs="*", help="further config overrides (KEY=VALUE)")
    args = parser.parse_args()
    overrides = engine_overrides(args.engine, args.vllm_python) + args.overrides
    ray.init(include_dashboard=False, log_to_driver=False)
    words = "what is the sum of these numbers please think step by step then answer".split()
    rows = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": f"problem {i}: " + " ".join(words[(i + j) % len(words)] for j in range(300)),
                }
            ],
            "agent_name": "fixed_length",
            "extra_info": {"length": 8},
        }
        for i in range(args.rows)
    ]
    results: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode, slack in (("off", "null"), ("on", "8")):
            results[mode].append(rollout(slack, rows, args.n, overrides))
            share, prefilled, wall = results[mode][-1]
            print(
                f"affinity {mode:3s}: cached share {share:.3f}, prefilled {prefilled:.0f} tokens, {wall:.2f}s",
                flush=True,
            )
    for mode, runs in results.items():
        share, prefilled, wall = np.mean(runs, axis=0)
        print(
            f"mean, affinity {mode:3s}: rollout/cached_token_share {share:.3f}, prompt tokens prefilled {prefilled:.0f}, wall {wall:.2f}s"
        )


if __name__ == "__main__":
    main()
