"""A judge-based reward against a rule reward: do the judge's calls overlap the other samples' rollouts?

    python -m benchmarks.judge [--samples 32] [--length 32] [--judge-length 16] [--repeats 3]

One manager with a judge (the tiny model, ``reward_model.enable``, its own server process beside the rollout
server). Each step rolls out ``--samples`` one-turn samples of exactly ``--length`` tokens (``fixed_length``) and
scores them with (r) a rule reward that costs nothing (``agentloop.testing.rule_reward``) or (j) a judge call of
exactly ``--judge-length`` tokens per sample (``agentloop.testing.judged_reward``); (g) is the judge's own
generation time, the same calls sent alone from here. Runs are interleaved, medians printed; the target is
j <= 1.2 x (r + g): a sample's judge call runs while the others still roll out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import ray

import agentloop.testing  # noqa: F401  (registers fixed_length)
from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare
from agentloop.judge import Judge

PROMPT = "grade this answer for its correctness and its style then say a number " * 3


def rows(kind: str, samples: int, length: int, judge_length: int) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"sample {i}: {PROMPT}"}],
            "agent_name": "fixed_length",
            "data_source": kind,
            "extra_info": {
                "index": i,
                "length": length,
                "judge_prompt": f"sample {i}: {PROMPT}",
                "judge_length": judge_length,
            },
        }
        for i in range(samples)
    ]


def timed_step(manager: AgentLoopManager, batch_rows: list[dict]) -> float:
    start = time.perf_counter()
    batch = manager.generate_sequences(batch_rows)
    assert not any(failure is not None for failure in batch.non_tensor_batch["failure"])
    return time.perf_counter() - start


def judge_alone(manager: AgentLoopManager, samples: int, judge_length: int) -> float:
    judge = Judge.from_settings(manager.judge_settings, manager.judges.servers)

    async def calls() -> None:
        await asyncio.gather(
            *(
                judge.chat(
                    [{"role": "user", "content": f"sample {i}: {PROMPT}"}], max_new_tokens=judge_length, ignore_eos=True
                )
                for i in range(samples)
            )
        )

    start = time.perf_counter()
    asyncio.run(calls())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--judge-length", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    manager = AgentLoopManager(
        prepare(
            compose_config(
                [
                    "reward_model.enable=true",
                    f"reward_model.rollout.response_length={args.judge_length}",
                    "+custom_reward_function.by_data_source.rule=agentloop.testing.rule_reward",
                    "+custom_reward_function.by_data_source.judged=agentloop.testing.judged_reward",
                ]
            )
        )
    )
    try:
        timed_step(manager, rows("judged", 2, args.length, args.judge_length))  # warm-up: kernels, caches, imports
        times: dict[str, list[float]] = {"rule": [], "judge alone": [], "judged": []}
        for _ in range(args.repeats):
            times["rule"].append(timed_step(manager, rows("rule", args.samples, args.length, args.judge_length)))
            times["judge alone"].append(judge_alone(manager, args.samples, args.judge_length))
            times["judged"].append(timed_step(manager, rows("judged", args.samples, args.length, args.judge_length)))
            print("  ".join(f"{name} {runs[-1]:.2f}s" for name, runs in times.items()), flush=True)
    finally:
        manager.shutdown()
    rule, alone, judged = (statistics.median(times[name]) for name in ("rule", "judge alone", "judged"))
    print(f"median: (r) rule-reward step {rule:.2f}s, (g) judge alone {alone:.2f}s, (j) judged step {judged:.2f}s")
    print(f"j / (r + g) = {judged / (rule + alone):.2f} (target <= 1.2); j / r = {judged / rule:.2f}")


if __name__ == "__main__":
    main()
