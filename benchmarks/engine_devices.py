"""The ``hf`` engine on each device and dtype: start-up (its self-test included), log-probs against a plain forward
pass in the same dtype, and generation throughput, for a GPU check (it needs no Ray, so it runs where only torch and
transformers are installed).

    python -m benchmarks.engine_devices [--models PATH ...] [--runs cuda:float32,cuda:bfloat16,cpu:float32]
                                        [--requests 256] [--new-tokens 64]

``--models`` defaults to the tiny model. Throughput is for ``--requests`` concurrent requests of ~200 prompt tokens
each generating ``--new-tokens`` (end of sequence ignored); CPU runs take a quarter of the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from agentloop.server.hf_engine import HFEngine

CHECK_PROMPTS = [list(range(3, 40)), list(range(3, 23)), list(range(8, 40))]


async def _gather(engine: HFEngine, prompts: list[list[int]], params: dict[str, Any], tag: str) -> list[Any]:
    return await asyncio.gather(*(engine.generate(prompt, params, f"{tag}-{i}") for i, prompt in enumerate(prompts)))


def max_log_prob_error(engine: HFEngine, path: str, device: str, dtype: str) -> float:
    """Largest difference between the engine's sampled-token log-probs and a plain forward pass's."""
    outputs = asyncio.run(
        _gather(engine, CHECK_PROMPTS, {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}, "check")
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    error = 0.0
    for prompt, output in zip(CHECK_PROMPTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output.token_ids], device=device)).logits[0].float()
        tokens = torch.tensor(output.token_ids, device=device)[:, None]
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, tokens)[:, 0].cpu()
        error = max(error, float((expected - torch.tensor(output.log_probs)).abs().max()))
    return error


def measure(path: str, device: str, dtype: str, requests: int, new_tokens: int) -> dict[str, Any]:
    row: dict[str, Any] = {"model": os.path.basename(path.rstrip("/")), "device": device, "dtype": dtype}
    start = time.perf_counter()
    try:
        engine = HFEngine(path, device=device, dtype=dtype, num_blocks=4096, max_batch_tokens=4096)
    except Exception as error:  # the self-test's message says what broke
        row["failed"] = f"{type(error).__name__}: {error}"
        return row
    row["start_s"] = time.perf_counter() - start
    try:
        row["max_log_prob_error"] = max_log_prob_error(engine, path, device, dtype)
        prompts = [list(range(3 + i % 50, 200 + i % 50)) for i in range(requests)]
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        asyncio.run(_gather(engine, prompts[:8], {**params, "max_new_tokens": 8}, "warm"))
        start = time.perf_counter()
        outputs = asyncio.run(_gather(engine, prompts, params, "run"))
        row["tokens_per_s"] = sum(len(output.token_ids) for output in outputs) / (time.perf_counter() - start)
    finally:
        asyncio.run(engine.shutdown())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--runs", default="cuda:float32,cuda:bfloat16,cpu:float32")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not args.models:
        from agentloop.models.tiny_qwen import tiny_model_path

        args.models = [tiny_model_path()]
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {cuda}")
    print("| model | device | dtype | start (s) | max log-prob error | tokens/s |\n|---|---|---|---|---|---|")
    for path in args.models:
        for run in args.runs.split(","):
            device, dtype = run.split(":")
            requests = args.requests if device == "cuda" else max(1, args.requests // 4)
            row = measure(path, device, dtype, requests, args.new_tokens)
            if "failed" in row:
                print(f"| {row['model']} | {device} | {dtype} | failed: {row['failed']} | | |")
            else:
                print(
                    f"| {row['model']} | {device} | {dtype} | {row['start_s']:.2f} | {row['max_log_prob_error']:.1e} | {row['tokens_per_s']:,.0f} |"
                )


if __name__ == "__main__":
    main()
