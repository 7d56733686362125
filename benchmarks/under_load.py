"""The quick start's warm start on a busy machine: its speed alone and beside a second busy process.

    python -m benchmarks.under_load [--steps 20] [--repeats 2] [--neighbours spin twin]

Each measurement is a fresh process training the warm start's first pass (the tiny model, batches of 16 of
its tool-protocol conversations, AdamW at its learning rate) for ``--steps`` steps after a short warm-up,
with torch's default threads (one per core). It runs alone, then beside a neighbour started just before it:
``spin`` a Python busy loop (one core's worth of work), ``twin`` a second warm start (the case in issue 49).
Two settings, interleaved in each repeat: (a) OpenMP as libgomp defaults, its idle threads spinning for ~3 ms
after each parallel region (torch imported before agentloop, which is how the code ran before), (b) as
shipped, ``OMP_WAIT_POLICY=PASSIVE`` set by ``import agentloop`` before torch loads. Prints each
measurement's steps/s and, per setting and neighbour, the median of "beside / alone" (the share of its speed
alone the warm start keeps; a fair share of 2 cores beside one busy process is 1/2 to 2/3) and "b / a" alone
(quiet-machine speed of the shipped setting against the old one). Figures are ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

SETTINGS = {"a": "libgomp default (spinning)", "b": "OMP_WAIT_POLICY=PASSIVE (shipped)"}
NEIGHBOURS = {"spin": [sys.executable, "-c", "while True: pass"]}


def train(steps: int, setting: str) -> None:
    """The measured process: warm-start steps, printing ``steps/s <rate>`` (and the wait policy torch loaded with)."""
    policy = os.environ.get("OMP_WAIT_POLICY")  # as torch loads in (a): the old order, torch before agentloop
    if setting == "a":
        import torch  # noqa: F401
    import agentloop  # noqa: F401  (in (b) before torch: it sets the wait policy libgomp starts with)

    if setting == "b":
        policy = os.environ.get("OMP_WAIT_POLICY")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentloop.models.tiny_qwen import tiny_model_path
    from agentloop.tasks.arithmetic.data import make_rows
    from agentloop.tasks.arithmetic.warm_start import conversation
    from agentloop.tools.toolset import load_tool_set

    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    schemas = load_tool_set("config/tools/arithmetic.yaml").schemas
    rows = make_rows(128, 0, split="warm_start", max_operand=9, compute_tool="calculator")
    rng = random.Random(0)
    encoded = [
        tokenizer.apply_chat_template(conversation(row, True, rng), tools=schemas, tokenize=True, return_dict=False)
        for row in rows
    ]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def step(index: int) -> None:
        batch = [encoded[(index * 16 + i) % len(encoded)] for i in range(16)]
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([list(ids) + [tokenizer.pad_token_id] * (width - len(ids)) for ids in batch])
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for index in range(3):
        step(index)
    start = time.perf_counter()
    for index in range(steps):
        step(index)
    rate = steps / (time.perf_counter() - start)
    print(f"steps/s {rate:.3f} (torch loaded with OMP_WAIT_POLICY={policy})", flush=True)


def measure(steps: int, setting: str, neighbour: str | None) -> float:
    """Steps/s of one fresh warm-start process with ``setting``, alone or beside ``neighbour``."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    command = [sys.executable, "-m", "benchmarks.under_load", "--train", str(steps), "--setting", setting]
    other = None
    if neighbour == "spin":
        other = subprocess.Popen(NEIGHBOURS["spin"])
    elif neighbour == "twin":  # the same warm start, started together, long enough to outlast the measured one
        other = subprocess.Popen(command[:4] + [str(steps * 3)] + command[5:], env=env, stdout=subprocess.DEVNULL)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("steps/s"))
    print(f"  ({setting}) {neighbour or 'alone':5s} {line}", flush=True)
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--neighbours", nargs="+", choices=["spin", "twin"], default=["spin", "twin"])
    parser.add_argument("--train", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="b", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train:
        train(args.train, args.setting)
        return
    print(f"{os.cpu_count()} cores; {args.steps} warm-start steps a measurement; settings: {SETTINGS}")
    shares: dict[tuple[str, str], list[float]] = {}
    alone_ratio: list[float] = []
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
        alone: dict[str, float] = {}
        for setting in SETTINGS if repeat % 2 == 0 else reversed(SETTINGS):
            alone[setting] = measure(args.steps, setting, None)
            for neighbour in args.neighbours:
                shares.setdefault((setting, neighbour), []).append(
                    measure(args.steps, setting, neighbour) / alone[setting]
                )
        alone_ratio.append(alone["b"] / alone["a"])
    for (setting, neighbour), values in shares.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        print(f"({setting}) beside {neighbour}: beside/alone median {statistics.median(values):.2f} ({spread})")
    print(f"alone b/a median {statistics.median(alone_ratio):.2f} ({min(alone_ratio):.2f}-{max(alone_ratio):.2f})")


if __name__ == "__main__":
    main()
