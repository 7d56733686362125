"""Long-tail multi-turn workload: request-level agent loops vs. batch-synchronous turns.

    python -m benchmarks.long_tail [--samples 64]

Each trajectory has 1-8 turns; a turn generates 8 tokens and is followed by a tool call with a
long-tailed latency (lognormal, median 0.1 s, sigma 1, capped at 2 s: most calls are quick, a few are slow). (a) runs every trajectory as its own
asyncio task, as agentloop does; (b) runs the same loops in lock step, every sample waiting for the
whole batch at each generation and each tool phase (the pre-AgentLoop way). Prints the makespan
ratio b/a (target >= 2.5) and a / the work bound (target <= 1.2), where the work bound is the larger
of the longest single trajectory (its turns at the unloaded per-turn time plus its tool latencies)
and the batch's tokens at the engine's measured peak throughput.
"""

from __future__ import annotations

import argparse
import math
import asyncio
import random
import time
from typing import Any

import ray

from agentloop import AgentLoopBase, AgentLoopManager, AgentLoopOutput, register
from agentloop.config import compose_config
from agentloop.preparation import prepare

TOKENS_PER_TURN = 8


class LockStep:
    """Phase barrier: no sample starts phase p + 1 before every sample in phase p is done with it."""

    def __init__(self, turns: list[int]) -> None:
        phases = 2 * max(turns)
        # generation phase 2t: samples with more than t turns; tool phase 2t + 1: more than t + 1 turns
        self.expected = [sum(k > p // 2 + (p % 2) for k in turns) for p in range(phases)]
        self.arrived = [0] * phases
        self.events = [asyncio.Event() for _ in range(phases)]

    async def done(self, phase: int) -> None:
        self.arrived[phase] += 1
        if self.arrived[phase] == self.expected[phase]:
            self.events[phase].set()
        await self.events[phase].wait()


_LOCKSTEPS: dict[str, LockStep] = {}


@register("bench_long_tail")
class LongTailLoop(AgentLoopBase):
    """``extra_info.latencies`` gives one tool latency per turn but the last; ``lockstep`` syncs phases."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        info = row["extra_info"]
        lockstep = _LOCKSTEPS.setdefault(info["batch"], LockStep(info["all_turns"])) if info["lockstep"] else None
        prompt_ids = self.encode_prompt(row["prompt"])
        response: list[int] = []
        params = {**sampling_params, "max_new_tokens": TOKENS_PER_TURN, "ignore_eos": True}
        for turn in range(info["turns"]):
            output = await self.server_manager.generate(row["request_id"], prompt_ids + response, params)
            response += output.token_ids
            if lockstep:
                await lockstep.done(2 * turn)
            if turn < info["turns"] - 1:
                await asyncio.sleep(info["latencies"][turn])
                if lockstep:
                    await lockstep.done(2 * turn + 1)
        return AgentLoopOutput(
            prompt_ids, response, [1] * len(response), [0.0] * len(response), num_turns=info["turns"]
        )


def make_rows(count: int, seed: int, lockstep: bool, batch: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    turns = [rng.randint(1, 8) for _ in range(count)]
    latencies = [[min(2.0, rng.lognormvariate(math.log(0.1), 1.0)) for _ in range(k - 1)] for k in turns]
    return [
        {
            "prompt": [{"role": "user", "content": f"task {i}"}],
            "agent_name": "bench_long_tail",
            "extra_info": {"turns": k, "latencies": lat, "lockstep": lockstep, "batch": batch, "all_turns": turns},
        }
        for i, (k, lat) in enumerate(zip(turns, latencies))
    ]


def timed(manager: AgentLoopManager, rows: list[dict[str, Any]]) -> float:
    start = time.perf_counter()
    manager.generate_sequences(rows)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. actor_rollout_ref.rollout.hf.num_blocks=4096"
    )
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = compose_config(
        [
            "data.max_prompt_length=64",
            f"data.max_response_length={8 * TOKENS_PER_TURN}",
            "actor_rollout_ref.rollout.resources_per_server.CPU=2",
            "actor_rollout_ref.rollout.agent.num_workers=1",  # lock step needs every sample in one process
            *args.overrides,
        ]
    )
    manager = AgentLoopManager(prepare(config))
    request_level = make_rows(args.samples, args.seed, lockstep=False, batch="a")
    timed(manager, request_level)  # warm-up

    # Work bound inputs: one trajectory's turn time when alone, and the engine's peak tokens/s.
    single = [dict(request_level[0], extra_info={**request_level[0]["extra_info"], "turns": 1, "latencies": []})]
    turn_alone = min(timed(manager, single) for _ in range(3))
    burst = [dict(row, extra_info={**row["extra_info"], "turns": 1}) for row in request_level]
    peak_rate = len(burst) * TOKENS_PER_TURN / min(timed(manager, burst) for _ in range(3))

    a = timed(manager, request_level)
    b = timed(manager, make_rows(args.samples, args.seed, lockstep=True, batch="b"))
    infos = [row["extra_info"] for row in request_level]
    chain = max(info["turns"] * turn_alone + sum(info["latencies"]) for info in infos)
    throughput = sum(info["turns"] for info in infos) * TOKENS_PER_TURN / peak_rate
    bound = max(chain, throughput)
    manager.shutdown()
    ray.shutdown()

    print(
        f"samples: {args.samples}, turns 1-8, {TOKENS_PER_TURN} tokens per turn, tool latency lognormal(median 0.1 s, sigma 1) <= 2 s"
    )
    print(f"(a) request-level makespan:      {a:.2f}s")
    print(f"(b) batch-synchronous makespan:  {b:.2f}s")
    print(f"ratio b/a: {b / a:.2f} (target >= 2.5)")
    print(
        f"work bound: {bound:.2f}s (longest trajectory {chain:.2f}s, throughput {throughput:.2f}s); "
        f"a / bound: {a / bound:.2f} (target <= 1.2)"
    )


if __name__ == "__main__":
    main()
