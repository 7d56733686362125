"""The hf engine's decoding step on CPU: inverse-CDF sampling vs. transformers' ``torch.multinomial``.

    python -m benchmarks.engine_step [--requests 32 128] [--threads 1] [--repeats 5]

Two ``HFEngine``s on the tiny default model in this process, identical but for the sampler: (a) the
engine as shipped (``hf_batching.sample_by_inverse_cdf``: one uniform draw per request), (b) the same
with transformers' own sampling (``torch.multinomial``: an exponential per vocabulary entry). For each
batch size, ``repeats`` alternating rounds of that many requests decoding 64 tokens each (eos ignored);
prints the best step time of each and the ratio b/a. Figures are ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from unittest import mock

import torch

from agentloop.config import compose_config
from agentloop.preparation import prepare
from agentloop.server import hf_batching
from agentloop.server.hf_engine import HFEngine
from agentloop.settings import rollout_settings

TOKENS = 64


async def step_s(engine: HFEngine, requests: int) -> float:
    params = {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0}
    start = time.perf_counter()
    await asyncio.gather(*(engine.generate([5, 6, 7 + i % 50] * 10, params, f"r{i}") for i in range(requests)))
    return (time.perf_counter() - start) / TOKENS


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = prepare(compose_config(["data.max_prompt_length=64", f"data.max_response_length={4 * TOKENS}"]))
    shipped = HFEngine.from_settings(rollout_settings(config).servers, 0)
    with mock.patch.object(hf_batching, "sample_by_inverse_cdf", lambda manager: None):
        multinomial = HFEngine.from_settings(rollout_settings(config).servers, 0)
    for engine in (shipped, multinomial):
        await step_s(engine, 4)  # warm-up
    print(f"torch threads: {args.threads}; best of {args.repeats} alternating rounds of {TOKENS} decoding steps")
    for requests in args.requests:
        times: dict[str, list[float]] = {"a": [], "b": []}
        for _ in range(args.repeats):
            times["a"].append(await step_s(shipped, requests))
            times["b"].append(await step_s(multinomial, requests))
        a, b = min(times["a"]), min(times["b"])
        print(
            f"{requests:4d} requests: (a) inverse CDF {a * 1000:.1f} ms/step, (b) multinomial {b * 1000:.1f} ms/step, b/a {b / a:.2f}"
        )
    for engine in (shipped, multinomial):
        await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
