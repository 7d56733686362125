"""Synchronous vs asynchronous training on the quick start's task, with a long-tailed tool latency.

    python -m benchmarks.async_training [--steps 8] [--repeats 2] [--max-staleness 1] [overrides ...]

Both modes train the quick start's job (``arithmetic_grpo``: warm-started tiny model, same data order,
same number of trained samples) for ``--steps`` steps; the calculator answers after a lognormal delay
(median 0.2 s, sigma 1, capped at 3 s), as a slow sandbox or web tool would. Runs alternate
sync, async, sync, ... (``--repeats`` each) so that machine noise hits both. Prints the wall-time ratio
sync/async of the training steps (start-up excluded; target >= 1.5), the mean reward of the last three
steps of each mode and the trained policy's mean reward on the 64 validation rows x 8 samples (the
reward it reached: an async run's batches come from policies about k versions older), each with its
standard error over the runs, the async runs' mean staleness, and each side's idle share
(``perf/idle_share/*``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml

from agentloop.config import CONFIG_DIR, compose_config
from agentloop.preparation import prepare
from agentloop.tasks.arithmetic.tools import CalculatorTool
from trainer.ray_trainer import RayPPOTrainer


class SlowCalculatorTool(CalculatorTool):
    """The calculator after a long-tailed delay."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        await asyncio.sleep(min(3.0, random.lognormvariate(np.log(0.2), 1.0)))
        return await super().execute(instance_id, parameters, **kwargs)


def slow_tools_yaml(directory: Path) -> str:
    tools = yaml.safe_load((CONFIG_DIR / "tools/arithmetic.yaml").read_text())
    tools["tools"][0]["class_name"] = "benchmarks.async_training.SlowCalculatorTool"
    path = directory / "slow_arithmetic.yaml"
    path.write_text(yaml.safe_dump(tools, sort_keys=False))  # the warm start is keyed by the schemas as written
    return str(path)


def train(mode: str, steps: int, tools: str, out: Path, max_staleness: int, extra: list[str]) -> dict[str, Any]:
    overrides = [
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
        f"trainer.default_local_dir={out}",
        "trainer.rollout_data_dir=null",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        # the final validation samples as training does (a greedy score saturates within these few steps)
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.n=8",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        f"async_training.max_staleness={max_staleness if mode == 'async' else 0}",
        *extra,
    ]
    if mode == "sync":  # the same loss as the async runs, whose correction is on by default
        overrides.append("algorithm.rollout_correction.rollout_is=token")
    trainer = RayPPOTrainer(prepare(compose_config(overrides, config_name="arithmetic_grpo")))
    try:
        start = time.perf_counter()
        history = trainer.fit()
        wall = time.perf_counter() - start
        # the trained policy itself on the held-out rows: the batches' reward lags it by the samples'
        # staleness in async mode
        validation = trainer.validate()["val/score/mean"]
    finally:
        trainer.shutdown()
    return {
        "wall_s": wall,
        "reward": float(np.mean([line["critic/score/mean"] for line in history[-3:]])),
        "validation": validation,
        "staleness": float(np.mean([line["async/staleness/mean"] for line in history])),
        "idle_ranks": float(np.mean([line["perf/idle_share/ranks"] for line in history])),
        "idle_servers": float(np.mean([line["perf/idle_share/servers"] for line in history])),
        "regenerated": float(sum(line.get("async/regenerated_groups", 0) for line in history)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for both modes, e.g. async_training.partial_rollout=false"
    )
    args = parser.parse_args()
    random.seed(0)
    # the workers import benchmarks.async_training.SlowCalculatorTool: Ray puts the driver's working directory
    # (the repository root, for python -m) on their path
    ray.init(include_dashboard=False, log_to_driver=False)
    results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        tools = slow_tools_yaml(Path(tmp))
        for repeat in range(args.repeats):
            for mode in ("sync", "async"):
                result = train(
                    mode, args.steps, tools, Path(tmp) / f"{mode}-{repeat}", args.max_staleness, args.overrides
                )
                results[mode].append(result)
                print(
                    f"{mode:5s} run {repeat}: " + ", ".join(f"{key} {value:.3f}" for key, value in result.items()),
                    flush=True,
                )
    mean = {mode: {key: float(np.mean([r[key] for r in runs])) for key in runs[0]} for mode, runs in results.items()}
    print(f"\n{args.steps} steps x 64 samples, {args.repeats} runs per mode")
    print(f"wall time sync/async: {mean['sync']['wall_s'] / mean['async']['wall_s']:.2f}  (target >= 1.5)")
    error = {
        mode: {
            key: float(np.std([r[key] for r in runs], ddof=1) / np.sqrt(len(runs))) if len(runs) > 1 else float("nan")
            for key in runs[0]
        }
        for mode, runs in results.items()
    }
    for key, title in (
        ("reward", "reward, mean of the last 3 steps"),
        ("validation", "validation reward of the trained policy"),
    ):
        print(
            f"{title}: "
            + ", ".join(f"{mode} {mean[mode][key]:.3f} ± {error[mode][key]:.3f}" for mode in mean)
            + " (± standard error)"
        )
    print(f"mean staleness: sync {mean['sync']['staleness']:.2f}, async {mean['async']['staleness']:.2f}")
    for side in ("ranks", "servers"):
        print(
            f"idle share of the {side}: sync {mean['sync'][f'idle_{side}']:.2f}, async {mean['async'][f'idle_{side}']:.2f}"
        )


if __name__ == "__main__":
    main()
