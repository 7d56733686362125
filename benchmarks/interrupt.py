"""A weight update that interrupts the requests in flight, against the same update with none in flight.

    python -m benchmarks.interrupt [--requests 64] [--repeats 5]

One rollout server (``hf`` engine, tiny default model) behind ``AgentLoopManager``. Each repeat pushes
the model's own weights twice through ``manager.update_weights``: once while ``--requests`` requests
of 200 tokens are decoding (the partial-rollout case of asynchronous training: the engine answers them
``interrupted`` with their tokens so far and restarts its batching loop), once after they have all
been answered (idle: the loop is paused in place). Prints the median of the per-repeat ratios
in-flight / idle; absolute times vary too much on this machine to compare across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from transformers import AutoModelForCausalLM

from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.preparation import prepare
from agentloop.protocol import TokenOutput


def timed_update(manager: AgentLoopManager, state: dict) -> float:
    start = time.perf_counter()
    manager.update_weights(state)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    config = compose_config(
        ["actor_rollout_ref.rollout.resources_per_server.CPU=2", "actor_rollout_ref.rollout.agent.num_workers=1"]
    )
    manager = AgentLoopManager(prepare(config))
    state = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path).state_dict()
    server = manager.servers[0]
    params = {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}
    ratios, busy_times, idle_times = [], [], []
    for repeat in range(args.repeats):
        requests = [server.generate.remote(list(range(3, 60)), params, f"r{repeat}-{i}") for i in range(args.requests)]
        time.sleep(0.5)  # every request admitted and decoding
        busy = timed_update(manager, state)
        outputs: list[TokenOutput] = ray.get(requests, timeout=120)
        idle = timed_update(manager, state)
        interrupted = sum(output.finish_reason == "interrupted" for output in outputs)
        print(
            f"repeat {repeat}: in flight {busy:.3f}s ({interrupted}/{args.requests} interrupted), idle {idle:.3f}s",
            flush=True,
        )
        ratios.append(busy / idle)
        busy_times.append(busy)
        idle_times.append(idle)
    manager.shutdown()
    ray.shutdown()
    print(f"\n{args.requests} requests in flight, {args.repeats} repeats")
    print(
        f"update with requests in flight: median {statistics.median(busy_times):.3f}s; idle: median {statistics.median(idle_times):.3f}s"
    )
    print(f"ratio in-flight / idle (median of per-repeat ratios): {statistics.median(ratios):.1f}")


if __name__ == "__main__":
    main()
