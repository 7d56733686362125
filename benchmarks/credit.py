"""Per-turn credit assignment: advantage estimators on the corridor task, steps to a reward threshold.

    python -m benchmarks.credit [--estimators grpo turn_grpo gigpo] [--seeds 0 1 2] [--steps 30] [--threshold 0.8]
                                [--out DIR] [--smoke] [overrides ...]

Every run trains ``corridor_grpo`` (``agentloop.tasks.corridor``: four left/right choices an episode, each with
its own reward, all junctions walked whatever the choices) from the same warm start for ``--steps`` steps, with
``algorithm.adv_estimator`` set to each of ``--estimators`` in turn and ``data.seed`` / ``rollout.seed`` set to
each seed; the estimators alternate within each seed so that machine noise hits them alike. Each run's
per-step mean reward (``critic/score/mean``, the batch's 64 trajectories) is read from the ``metrics.jsonl`` it
logs. Prints, per estimator, medians over the seeds of: the first step whose reward reaches ``--threshold``,
the first step whose reward reaches the reference estimator's final reward (the first of ``--estimators``,
grpo by default; target for a turn-level estimator: at most half the steps), the final reward (mean of the
last 5 steps) and the training wall time; and the ratio of its steps to the threshold to the reference's.
``--out`` keeps each run's directory (``<estimator>-<seed>``: metrics, training curves); ``--smoke`` is a 2-step run
of 2 prompts x 4 samples on the first seed, to check the pipeline (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray

from agentloop.config import compose_config
from agentloop.preparation import prepare
from trainer.ray_trainer import RayPPOTrainer

SMOKE = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "actor_rollout_ref.rollout.hf.num_blocks=256",
]
FINAL_WINDOW = 5


@dataclass
class Run:
    """One training run: its estimator, seed, per-step mean rewards (step 1 first) and training wall time."""

    estimator: str
    seed: int
    rewards: list[float]
    wall_s: float

    @property
    def final(self) -> float:
        return float(np.mean(self.rewards[-FINAL_WINDOW:]))

    def steps_to(self, level: float) -> float:
        """The first step whose mean reward reaches ``level`` (inf: none did)."""
        return next((step for step, reward in enumerate(self.rewards, 1) if reward >= level), math.inf)


def train(estimator: str, seed: int, steps: int, out: Path, overrides: list[str]) -> Run:
    """Train ``corridor_grpo`` with ``estimator`` and ``seed``; the rewards come from the run's ``metrics.jsonl``."""
    config = compose_config(
        [
            f"algorithm.adv_estimator={estimator}",
            f"data.seed={seed}",
            f"actor_rollout_ref.rollout.seed={seed}",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.logger=[]",
            f"trainer.default_local_dir={out}",
            "trainer.rollout_data_dir=null",
            *overrides,
        ],
        config_name="corridor_grpo",
    )
    prepare(config)
    trainer = RayPPOTrainer(config)
    try:
        start = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - start
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return Run(estimator, seed, [line["critic/score/mean"] for line in lines if "critic/score/mean" in line], wall)


def compare(estimators: list[str], seeds: list[int], steps: int, directory: Path, overrides: list[str]) -> list[Run]:
    """Every estimator on every seed, the estimators alternating within each seed."""
    runs = []
    for seed in seeds:
        for estimator in estimators:
            run = train(estimator, seed, steps, directory / f"{estimator}-{seed}", overrides)
            runs.append(run)
            print(
                f"{estimator} seed {seed}: rewards {' '.join(f'{r:.2f}' for r in run.rewards)}; final {run.final:.3f}, "
                f"{run.wall_s:.0f} s",
                flush=True,
            )
    return runs


def report(runs: list[Run], estimators: list[str], steps: int, threshold: float) -> list[dict[str, float | str]]:
    """One row per estimator: medians over its seeds, and its steps to the threshold over the reference's."""
    by_estimator = {name: [run for run in runs if run.estimator == name] for name in estimators}
    reference = estimators[0]
    target = float(np.median([run.final for run in by_estimator[reference]]))
    reference_steps = float(np.median([run.steps_to(threshold) for run in by_estimator[reference]]))
    rows = []
    for name, group in by_estimator.items():
        to_threshold = float(np.median([run.steps_to(threshold) for run in group]))
        rows.append(
            {
                "estimator": name,
                "steps_to_threshold": to_threshold,
                "steps_to_reference_final": float(np.median([run.steps_to(target) for run in group])),
                "final": float(np.median([run.final for run in group])),
                "wall_s": float(np.median([run.wall_s for run in group])),
                "ratio": to_threshold / reference_steps if math.isfinite(to_threshold + reference_steps) else math.nan,
            }
        )
    seeds = len(by_estimator[reference])
    print(f"\n{steps} steps, {seeds} seed(s) each, medians over seeds; {reference}'s final reward {target:.3f}")
    print(
        f"| estimator | steps to {threshold:g} | steps to {reference}'s final {target:.3f} (target <= {steps / 2:g}) | "
        f"final reward (last {FINAL_WINDOW} steps) | wall time | steps to {threshold:g} / {reference}'s |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        ratio = "—" if math.isnan(row["ratio"]) else f"{row['ratio']:.2f}"
        reached = f"{_steps(row['steps_to_threshold'], steps)} | {_steps(row['steps_to_reference_final'], steps)}"
        print(f"| {row['estimator']} | {reached} | {row['final']:.3f} | {row['wall_s']:.0f} s | {ratio} |")
    return rows


def _steps(value: float, steps: int) -> str:
    return f"> {steps}" if math.isinf(value) else f"{value:g}"


def main(argv: list[str] | None = None) -> list[dict[str, float | str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--estimators",
        nargs="+",
        default=["grpo", "turn_grpo", "gigpo"],
        help="values of algorithm.adv_estimator; the first is the reference",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--threshold", type=float, default=0.8, help="reward level to reach (the task's rewards are at most 1)"
    )
    parser.add_argument("--out", type=Path, help="keep each run's directory here (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="2 steps of 2 prompts x 4 samples on the first seed")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. algorithm.gamma=0.9")
    args = parser.parse_args(argv)
    steps, seeds, overrides = args.steps, args.seeds, args.overrides
    if args.smoke:
        steps, seeds, overrides = 2, seeds[:1], [*SMOKE, *overrides]
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        runs = compare(args.estimators, seeds, steps, args.out or Path(tmp), overrides)
    return report(runs, args.estimators, steps, args.threshold)


if __name__ == "__main__":
    main()
