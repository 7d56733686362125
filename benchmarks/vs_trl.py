"""agentloop against TRL's GRPOTrainer, side by side on the quick start's task (needs ``pip install -e ".[bench]"``).

    python -m benchmarks.vs_trl [--workloads a,b,c,d] [--repeats 1] [--steps 40] [--smoke]

Both train the warm-started tiny model on the quick start's arithmetic rows, in the same order, with the
``calculator`` and ``submit_answer`` tools (the same schemas in the prompt), 8 prompts x 8 samples per step,
lr 3e-4, temperature 1.0, no KL, token-mean loss, group-scaled rewards and the same turn and length limits.
agentloop runs ``python -m trainer.main_ppo`` (the quick start with overrides); TRL runs ``GRPOTrainer`` with
``environment_factory`` (its multi-turn tool loop, tool results masked out of the loss) in one CPU process.
Each run is its own subprocess, timed from the command to its exit; the systems alternate, repeat after repeat.

Workloads: (a) the quick start as it is; (b) every tool call first waits a lognormal latency (median 0.1 s,
sigma 1, capped at 2 s, as ``long_tail``); (c) longer episodes: a warm start that solves in four model turns with a
sentence each (compute, check with a second call, submit, close; ``warm_start_path(long_episodes=True)``), with 8 model
turns and 512 response tokens allowed;
(d) agentloop asynchronous (``arithmetic_grpo_async``) on (b), against (b)'s TRL runs; (e) (c) with agentloop's
rollouts on vLLM (``AGENTLOOP_VLLM_PYTHON=$(python -m agentloop.server.vllm_env)``), against (c)'s TRL runs.

Prints, per workload, the medians over repeats of: median step time, sum of the steps, whole run, start-up
(launch to the first step's start) and wall time to equal reward (launch to the end of the first step whose
5-step mean reward is >= 0.5), then every run's reward curve; writes all runs to ``outputs/vs_trl/<time>/runs.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentloop.tasks.arithmetic.tools import AnswerTool, CalculatorTool, evaluate

ROOT = Path(__file__).resolve().parent.parent
QUICK_START_TOOLS = ROOT / "config" / "tools" / "arithmetic.yaml"
REWARD_TARGET, REWARD_WINDOW = 0.5, 5
PROMPTS_PER_STEP, GROUP_SIZE, LR = 8, 8, 3e-4
TRAIN_SPLIT = ("train", 512, 9)  # the quick start's data.train_files: (split, rows, largest operand)

# ---------------------------------------------------------------- tool latency, the same stream on both sides

LATENCY_SEED = 0
_latency_stream = random.Random(LATENCY_SEED)  # one per process: each agentloop worker and the TRL process


def tool_latency() -> float:
    """The next tool latency of this process's stream: lognormal, median 0.1 s, sigma 1, capped at 2 s."""
    return min(2.0, _latency_stream.lognormvariate(math.log(0.1), 1.0))


class LognormalLatency:
    """Tool mixin: every call waits ``tool_latency()`` first (agentloop runs calls concurrently, so the waits overlap)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        await asyncio.sleep(tool_latency())
        return await super().execute(instance_id, parameters, **kwargs)


class SlowCalculatorTool(LognormalLatency, CalculatorTool):
    """The quick start's calculator behind a long-tailed latency."""


class SlowAnswerTool(LognormalLatency, AnswerTool):
    """The quick start's submit_answer behind a long-tailed latency."""


def slow_tool_config(directory: Path) -> Path:
    """The quick start's tool YAML with the slow classes named in it (same schemas, so the same warm start)."""
    config = yaml.safe_load(QUICK_START_TOOLS.read_text())
    slow = {CalculatorTool.__name__: SlowCalculatorTool, AnswerTool.__name__: SlowAnswerTool}
    for entry in config["tools"]:
        # this module as the trainer's processes import it (run with -m, it is __main__ here)
        entry["class_name"] = f"benchmarks.vs_trl.{slow[entry['class_name'].rsplit('.', 1)[1]].__name__}"
    path = directory / "arithmetic_slow.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ---------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    slow_tools: bool = False
    max_assistant_turns: int = 4  # the quick start's multi_turn.max_assistant_turns
    long_episodes: bool = False  # the warm start that solves in four model turns with text (both systems train it)
    response_length: int = 128  # the quick start's data.max_response_length: model turns and tool results together
    agentloop_config: str = "arithmetic_grpo"
    trl_runs_of: str | None = None  # a workload whose TRL runs this one is compared with (TRL has no async mode)
    rollout_engine: str = (
        "hf"  # vllm: rollout.vllm.python from AGENTLOOP_VLLM_PYTHON (python -m agentloop.server.vllm_env)
    )

    def agentloop_overrides(self, tools_dir: Path) -> list[str]:
        overrides = [
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={self.max_assistant_turns}",
            f"actor_rollout_ref.rollout.multi_turn.max_user_turns={max(5, self.max_assistant_turns)}",
            f"data.max_response_length={self.response_length}",
        ]
        if self.slow_tools:
            overrides.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={slow_tool_config(tools_dir)}")
        if self.long_episodes:
            overrides.append(f"actor_rollout_ref.model.path={warm_start(long_episodes=True)}")
        if self.rollout_engine == "vllm":
            python = os.environ.get("AGENTLOOP_VLLM_PYTHON")
            if not python:
                raise SystemExit("workload e needs AGENTLOOP_VLLM_PYTHON=$(python -m agentloop.server.vllm_env)")
            overrides += ["actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.vllm.python={python}"]
        return overrides


def warm_start(long_episodes: bool) -> str:
    """The checkpoint both systems start from (built on first use, outside any timed run)."""
    from agentloop.tasks.arithmetic.warm_start import warm_start_path  # torch and transformers: only when needed

    return warm_start_path(str(QUICK_START_TOOLS), long_episodes=long_episodes)


WORKLOADS = {
    "a": Workload("a", "the quick start as it is"),
    "b": Workload("b", "tool latency lognormal (median 0.1 s, sigma 1, <= 2 s)", slow_tools=True),
    "c": Workload(
        "c",
        "longer episodes: four model turns with text each (8 allowed, 512 response tokens)",
        max_assistant_turns=8,
        response_length=512,
        long_episodes=True,
    ),
    "d": Workload(
        "d",
        "agentloop asynchronous (arithmetic_grpo_async) on (b)",
        slow_tools=True,
        agentloop_config="arithmetic_grpo_async",
        trl_runs_of="b",
    ),
    "e": Workload(
        "e",
        "(c) with agentloop's rollouts on vLLM (rollout.name=vllm)",
        max_assistant_turns=8,
        response_length=512,
        long_episodes=True,
        trl_runs_of="c",
        rollout_engine="vllm",
    ),
}

UNMATCHED = [
    "agentloop validates on 64 rows before training and every 10 steps (the quick start's test_freq); TRL does not "
    "evaluate. Counts against agentloop in start-up, whole run and time to reward (not in step times).",
    "agentloop writes a rollout dump and pushes weights each step (neither exists in TRL's one process). Counts "
    "against agentloop. (Neither runs a separate old-log-prob pass: one update per batch takes them from its own "
    "forward passes.)",
    "agentloop trains on two FSDP ranks (two processes, one core each), TRL in one process using both cores.",
    "TRL generates a turn for the whole batch with transformers' generate (each turn waits for its longest sample) and "
    "re-reads the prompt every turn; agentloop's engine batches continuously and reuses the prefix cache.",
    "TRL runs a turn's tool calls one sample after another (it awaits each sample's calls before the next), so in (b) "
    "the batch's latencies add up; agentloop runs them concurrently. This is TRL's design, not a setting: it is "
    "what (b) measures. Latency streams: one seeded stream per process (TRL's one, each agentloop worker's own).",
    "Sampling is not the same random stream (torch generators differ), so the rollouts differ from step 1: the reward "
    "curves are comparable only in distribution. With one repeat, time to reward is noisy either way.",
    "GRPO's std: agentloop adds 1e-6 to the group std, TRL 1e-4; PPO clipping is moot at one update per batch. "
    "agentloop's dual-clip (clip_ratio_c) has no TRL counterpart (moot likewise).",
    "A tool error reads differently (agentloop: an error text of its tool set; TRL: {'error': ...}); rare here.",
]


# ---------------------------------------------------------------- runs and their figures


@dataclass
class Step:
    step: int
    end_s: float  # since launch, when the step's metrics appeared (agentloop: after that step's validation, if any)
    seconds: float  # the step's own time (agentloop: timing_s/step; TRL: on_step_begin -> on_step_end)
    reward: float
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class Run:
    system: str
    workload: str
    repeat: int
    wall_s: float
    returncode: int
    steps: list[Step]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    log: str

    @property
    def startup_s(self) -> float | None:
        return self.steps[0].end_s - self.steps[0].seconds if self.steps else None

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(s.seconds for s in self.steps) if self.steps else None

    @property
    def steps_sum_s(self) -> float | None:
        return sum(s.seconds for s in self.steps) if self.steps else None

    @property
    def to_reward_s(self) -> float | None:
        """Launch to the end of the first step whose trailing 5-step mean reward reaches the target; None: never."""
        rewards = [s.reward for s in self.steps]
        for index in range(REWARD_WINDOW - 1, len(rewards)):
            if statistics.fmean(rewards[index - REWARD_WINDOW + 1 : index + 1]) >= REWARD_TARGET:
                return self.steps[index].end_s
        return None


def launch(command: list[str], log: Path, watch: Path | None = None) -> tuple[float, int, dict[int, float]]:
    """Run ``command`` to its exit (output to ``log``); returns its wall time, exit code and, when ``watch`` names a
    JSONL file, when (seconds since launch) each of its lines appeared."""
    appeared: dict[int, float] = {}
    done = threading.Event()
    start = time.perf_counter()

    def follow() -> None:  # the file is appended one line per step: note when each arrives
        while not done.wait(0.05):
            if watch.exists():
                count = watch.read_text().count("\n")
                for line in range(len(appeared), count):
                    appeared[line] = time.perf_counter() - start

    watcher = threading.Thread(target=follow, daemon=True) if watch else None
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        if watcher:
            watcher.start()
        returncode = process.wait()
    wall = time.perf_counter() - start
    done.set()
    if watcher:
        watcher.join()
    return wall, returncode, appeared


def run_agentloop(workload: Workload, steps: int, directory: Path) -> tuple[float, int, list[Step]]:
    output = directory / "agentloop"
    command = [
        sys.executable,
        "-m",
        "trainer.main_ppo",
        "--config-name",
        workload.agentloop_config,
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={output}",
        *workload.agentloop_overrides(directory),
    ]
    metrics = output / "metrics.jsonl"
    wall, returncode, appeared = launch(command, directory / "agentloop.log", watch=metrics)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    extra_keys = ("timing_s/gen", "timing_s/train", "response_length/mean", "num_turns/mean")
    return (
        wall,
        returncode,
        [
            Step(
                line["step"],
                appeared.get(index, wall),
                line["timing_s/step"],
                line["critic/score/mean"],
                {key: line[key] for key in extra_keys if key in line},
            )
            for index, line in enumerate(lines)
            if "timing_s/step" in line  # step 0: validation only
        ],
    )


def run_trl(workload: Workload, steps: int, directory: Path) -> tuple[float, int, list[Step]]:
    record = directory / "trl_steps.jsonl"
    spec = {"steps": steps, "output": str(directory / "trl"), "record": str(record), **asdict(workload)}
    launched = time.time()
    wall, returncode, _ = launch(
        [sys.executable, "-m", "benchmarks.vs_trl", "--trl-worker", json.dumps(spec)], directory / "trl.log"
    )
    lines = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    extra_keys = ("completions/mean_length", "tools/call_frequency")
    return (
        wall,
        returncode,
        [
            Step(
                line["step"],
                line["end"] - launched,
                line["end"] - line["begin"],
                line["reward"],
                {key: line[key] for key in extra_keys if key in line},
            )
            for line in lines
        ],
    )


# ---------------------------------------------------------------- the TRL side (in its own process)


class ArithmeticEnvironment:
    """TRL's ``environment_factory`` side of the task: agentloop's calculator and submit_answer, and its reward (1 when
    the last submitted answer is right). Public methods are TRL's tools; TRL calls them synchronously."""

    def __init__(self, slow: bool) -> None:
        self.slow, self.truth, self.answer = slow, None, None

    def reset(self, ground_truth: str, **row: Any) -> None:
        self.truth, self.answer = float(ground_truth), None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. 12 * (3 + 4)
        """
        self._wait()
        return str(evaluate(expression))

    def submit_answer(self, answer: float) -> str:
        """Submit the final numeric answer.

        Args:
            answer: the answer
        """
        self._wait()
        self.answer = answer
        return "correct" if self.get_reward() else "incorrect"

    def get_reward(self) -> float:
        try:
            return float(self.answer is not None and abs(float(self.answer) - self.truth) < 1e-6)
        except (TypeError, ValueError):
            return 0.0

    def _wait(self) -> None:
        if self.slow:
            time.sleep(tool_latency())


def trl_worker(spec: dict[str, Any]) -> None:
    """Train with TRL's GRPOTrainer as ``spec`` says, appending one JSON line per step (wall-clock times) to its record."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from agentloop.tasks.arithmetic.data import cached_split
    from agentloop.tools.toolset import load_tool_set
    from trainer.data import BatchSampler, read_rows

    model = warm_start(spec["long_episodes"])
    rows = read_rows(cached_split(*TRAIN_SPLIT))
    # agentloop's order: its sampler's batches (data.seed 0, shuffled), handed to TRL unshuffled
    order = [
        index for batch in BatchSampler(len(rows), PROMPTS_PER_STEP, seed=0).batches(spec["steps"]) for index in batch
    ]
    dataset = Dataset.from_list(
        [{"prompt": rows[i]["prompt"], "ground_truth": rows[i]["reward_model"]["ground_truth"]} for i in order]
    )
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    tokenizer.response_template = qwen3_template  # the tiny model writes Qwen3's hermes tool calls

    record = open(spec["record"], "a")

    class StepClock(TrainerCallback):
        begin = end = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            self.end = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:  # a step's log (not the run's summary)
                numbers = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                record.write(
                    json.dumps({"step": state.global_step, "begin": self.begin, "end": self.end, **numbers}) + "\n"
                )
                record.flush()

    config = GRPOConfig(
        output_dir=spec["output"],
        max_steps=spec["steps"],
        seed=0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
        gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE,
        shuffle_dataset=False,
        remove_unused_columns=False,
        max_completion_length=spec["response_length"],
        max_tool_calling_iterations=spec["max_assistant_turns"] - 1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",  # dapo: token-mean over the batch, as agentloop's loss_agg_mode
        gradient_checkpointing=False,  # TRL's default is on; agentloop's enable_gradient_checkpointing is off
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
    )
    trainer = GRPOTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
        environment_factory=lambda: ArithmeticEnvironment(spec["slow_tools"]),
    )
    # the prompt shows the tool schemas as agentloop renders them (the YAML's; the warm start learnt these), not the
    # ones TRL derives from the methods' docstrings (which add a return type and an answer description)
    schemas = load_tool_set(str(QUICK_START_TOOLS)).schemas
    trainer._env_tools = {name: schemas for name in trainer._env_tools}
    trainer.tools = schemas
    trainer.train()
    record.close()


# ---------------------------------------------------------------- report


def median_of(runs: list[Run], figure: str) -> tuple[float | None, str]:
    """The median of ``figure`` over the runs (None if any run lacks it) and its range as text."""
    values = [getattr(run, figure) for run in runs]
    if not values or any(value is None for value in values):
        reached = sum(value is not None for value in values)
        return None, f"reached in {reached}/{len(values)} runs" if figure == "to_reward_s" else "missing"
    spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    return statistics.median(values), spread


def report(workload: Workload, ours: list[Run], theirs: list[Run]) -> None:
    print(f"\n({workload.name}) {workload.title}: {len(ours)} agentloop run(s), {len(theirs)} TRL run(s), medians")
    print("| figure | agentloop | TRL | TRL / agentloop |\n|---|---|---|---|")
    rows = [
        ("median step time", "median_step_s"),
        ("sum of the steps", "steps_sum_s"),
        ("whole run, command to exit", "wall_s"),
        ("start-up, launch to first step", "startup_s"),
        (f"launch to a {REWARD_WINDOW}-step mean reward >= {REWARD_TARGET}", "to_reward_s"),
    ]
    for label, figure in rows:
        (a, a_note), (t, t_note) = median_of(ours, figure), median_of(theirs, figure)
        ratio = f"{t / a:.2f}" if a and t else "-"
        print(f"| {label} | {_cell(a, a_note)} | {_cell(t, t_note)} | {ratio} |")
    for run in ours + theirs:
        rewards = [s.reward for s in run.steps]
        last = statistics.fmean(rewards[-REWARD_WINDOW:]) if rewards else float("nan")
        extras = {
            key: statistics.fmean(s.extra[key] for s in run.steps if key in s.extra)
            for key in (run.steps[0].extra if run.steps else {})
        }
        print(
            f"  {run.system:9} r{run.repeat} rc={run.returncode} reward {rewards[0] if rewards else float('nan'):.2f} -> "
            f"{last:.2f} (last {REWARD_WINDOW}); load {run.load_before[0]:.1f}->{run.load_after[0]:.1f}; "
            + ", ".join(f"{key} {value:.3g}" for key, value in extras.items())
        )
        print("    " + " ".join(f"{r:.2f}".lstrip("0") or "0" for r in rewards))


def _cell(value: float | None, note: str) -> str:
    return f"{value:.1f} s{note}" if value is not None else f"never ({note})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a,b,c,d")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="2 steps of (a) on both systems: does everything run")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)  # internal: the TRL side of one run, as JSON
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    names = ["a"] if args.smoke else args.workloads.split(",")
    steps, repeats = (2, 1) if args.smoke else (args.steps, args.repeats)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    out = ROOT / "outputs" / "vs_trl" / time.strftime("%Y%m%d-%H%M%S")
    runs: list[Run] = []
    for repeat in range(1, repeats + 1):
        for name in names:
            workload = WORKLOADS[name]
            systems = [("agentloop", run_agentloop)]
            if not (workload.trl_runs_of and workload.trl_runs_of in names):
                systems.append(("TRL", run_trl))
            for system, run in systems:  # alternating: A B, A B, ...
                directory = out / f"{name}-{system}-r{repeat}"
                directory.mkdir(parents=True)
                load_before = os.getloadavg()
                wall, returncode, step_list = run(workload, steps, directory)
                runs.append(
                    Run(
                        system,
                        name,
                        repeat,
                        wall,
                        returncode,
                        step_list,
                        load_before,
                        os.getloadavg(),
                        str(directory / f"{system.lower()}.log"),
                    )
                )
                print(f"{name} {system} r{repeat}: {wall:.0f} s, rc {returncode}, {len(step_list)} steps", flush=True)
    (out / "runs.json").write_text(
        json.dumps(
            [
                {
                    **asdict(run),
                    "startup_s": run.startup_s,
                    "median_step_s": run.median_step_s,
                    "steps_sum_s": run.steps_sum_s,
                    "to_reward_s": run.to_reward_s,
                }
                for run in runs
            ],
            indent=1,
        )
    )
    import trl

    print(f"\nagentloop vs TRL {trl.__version__}, {steps} steps, {os.cpu_count()} CPUs; runs: {out / 'runs.json'}")
    for name in names:
        workload = WORKLOADS[name]
        trl_name = workload.trl_runs_of if workload.trl_runs_of in names else name
        report(
            workload,
            [r for r in runs if r.system == "agentloop" and r.workload == name],
            [r for r in runs if r.system == "TRL" and r.workload == trl_name],
        )
    print("\nNot matched (and which way it biases TRL / agentloop):")
    for line in UNMATCHED:
        print(f"- {line}")


if __name__ == "__main__":
    main()
