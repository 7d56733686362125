"""Weight push: FSDP gather + push to the rollout servers, against one serialization of the same weights.

    python -m benchmarks.weight_sync [--repeats 5] [--models tiny,medium] [--asleep]
    python -m benchmarks.weight_sync --paths object_store,collective,disk [--servers 1,2,4] [--models tiny]

Two policy ranks (FSDP2 over gloo) and one rollout server (``hf`` engine), for (a) the tiny default
model and (b) ``medium``, a ~77M-parameter model of the same architecture with random weights, built
once into the agentloop cache. One push is timed two ways: as the trainer does it (``trainer.fsdp_workers.push_weights``: rank 0 packs
its gathered dict, the servers read it from the object store) and, for comparison, through the driver
(rank 0's dict returns to the driver, which calls ``AgentLoopManager.update_weights``).
The baseline is one ``torch.save`` of the gathered state dict into an ``io.BytesIO``; the gather alone
is timed too. ``--asleep`` pushes to sleeping servers, as the trainer does with
``rollout.free_cache_engine=true``. Repeats are interleaved; printed are the medians of the per-repeat
ratios (target for a push <= 1.5). Ratios within one run only: absolute times vary too much here.

``--paths`` compares the weight paths (``rollout.weight_sync``) instead, each as the trainer pushes
(``push_weights(..., path=...)``), on 1, 2 and 4 ``hf`` servers: seconds per push (medians, paths interleaved) and
bytes each server receives (the packed state from the object store; the broadcast buckets; the checkpoint files read
from ``weight_sync_dir``).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from pathlib import Path
from typing import Callable

import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.server.collective import bucket_plan
from agentloop.waiting import wait_for
from benchmarks.models import scaled_tiny_model
from benchmarks.real_size import real_size_model_path
from trainer.fsdp_workers import FSDPWorker, push_weights, start_workers
from trainer.settings import rank_settings

RANKS = 2
TIMEOUT_S = 300.0
Ranks = list[ray.actor.ActorHandle]


def medium_model_path() -> str:
    """A Qwen3 like the tiny model but 768 wide and 12 layers deep (~77M parameters, ~310 MB in fp32)."""
    return scaled_tiny_model(
        "bench-qwen3-medium-v1",
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    )


@ray.remote
class BenchRank(FSDPWorker.__ray_actor_class__):  # the undecorated class: the trainer's rank as is
    """A policy rank that can also time its gather from the inside."""

    def pushed_directory(self) -> str | None:
        return getattr(self, "_pushed_directory", None)

    def timed_gather(self) -> float:
        start = time.perf_counter()
        self.full_state_dict()
        return time.perf_counter() - start


def push_through_driver(ranks: Ranks, manager: AgentLoopManager, timeout_s: float) -> None:
    """The first design, for comparison: the gathered dict is fetched by the driver, which pushes it."""
    state, *_ = wait_for([rank.full_state_dict.remote() for rank in ranks], timeout_s, "the weight gather")
    manager.update_weights(state)


def serialize_s(state: dict[str, torch.Tensor]) -> float:
    """The baseline: one ``torch.save`` of the state dict into memory."""
    start = time.perf_counter()
    torch.save(state, io.BytesIO())
    return time.perf_counter() - start


def gather_s(ranks: Ranks) -> float:
    return wait_for([rank.timed_gather.remote() for rank in ranks], TIMEOUT_S, "the timed gather")[0]


def timed(push: Callable[[Ranks, AgentLoopManager, float], None], ranks: Ranks, manager: AgentLoopManager) -> float:
    start = time.perf_counter()
    push(ranks, manager, TIMEOUT_S)
    return time.perf_counter() - start


def measure(model_path: str, repeats: int, asleep: bool) -> dict[str, float]:
    """Median ratios to the baseline of: the trainer's push, the push through the driver, the gather alone."""
    manager = AgentLoopManager(
        compose_config(
            [
                f"actor_rollout_ref.model.path={model_path}",
                "data.max_prompt_length=96",
                "data.max_response_length=24",
                "actor_rollout_ref.rollout.hf.num_blocks=256",
                "actor_rollout_ref.rollout.agent.num_workers=1",
            ]
        )
    )
    ranks = start_workers(rank_settings(manager.config), RANKS, 1, TIMEOUT_S, worker_class=BenchRank)
    state, *_ = wait_for([rank.full_state_dict.remote() for rank in ranks], TIMEOUT_S, "the first gather")
    push_through_driver(ranks, manager, TIMEOUT_S), push_weights(ranks, manager, TIMEOUT_S)  # warm-up
    if asleep:
        manager.sleep()
    ratios: dict[str, list[float]] = {"trainer": [], "driver": [], "gather": []}
    for _ in range(repeats):
        baseline = serialize_s(state)
        ratios["trainer"].append(timed(push_weights, ranks, manager) / baseline)
        ratios["driver"].append(timed(push_through_driver, ranks, manager) / baseline)
        ratios["gather"].append(gather_s(ranks) / baseline)
    wait_for([rank.shutdown.remote() for rank in ranks], TIMEOUT_S, "the policy ranks to shut down")
    for rank in ranks:
        ray.kill(rank)
    manager.shutdown()
    return {
        "params_m": sum(tensor.numel() for tensor in state.values()) / 1e6,
        "mb": sum(tensor.numel() * tensor.element_size() for tensor in state.values()) / 1e6,
        **{name: statistics.median(values) for name, values in ratios.items()},
    }


def path_bytes(path: str, state: dict[str, torch.Tensor], directory: str | None, served_dtype: str) -> int:
    """Bytes one server receives per push on ``path`` (the object store's: cast to ``served_dtype`` as gathered)."""
    if path == "disk":
        return sum(file.stat().st_size for file in Path(directory or "").glob("*.safetensors"))
    if path == "collective":
        manifest = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]
        return sum(size for size, _ in bucket_plan(manifest, int(64 * 2**20)))
    element = torch.empty(0, dtype=getattr(torch, served_dtype)).element_size()
    return sum(tensor.numel() * element for tensor in state.values())


def measure_paths(
    model_path: str, servers: int, paths: list[str], repeats: int, served_dtype: str = "float32"
) -> dict[str, tuple[float, int]]:
    """Per path: the median seconds of a push to ``servers`` servers (weights served in ``served_dtype``), and the
    bytes each server receives."""
    manager = AgentLoopManager(
        compose_config(
            [
                f"actor_rollout_ref.model.path={model_path}",
                "data.max_prompt_length=96",
                "data.max_response_length=24",
                "actor_rollout_ref.rollout.hf.num_blocks=64",
                "actor_rollout_ref.rollout.agent.num_workers=1",
                f"actor_rollout_ref.rollout.data_parallel_size={servers}",
                "actor_rollout_ref.rollout.resources_per_server.CPU=0.5",
                f"actor_rollout_ref.rollout.dtype={served_dtype}",
            ]
        )
    )
    ranks = start_workers(rank_settings(manager.config), RANKS, 1, TIMEOUT_S, worker_class=BenchRank)
    # the policy's names, shapes and dtypes without gathering it (a whole copy in the driver would not fit at 0.6B)
    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)).state_dict()
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    for repeat in range(repeats + 1):  # the first round warms up
        for path in paths:
            start = time.perf_counter()
            push_weights(ranks, manager, TIMEOUT_S, repeat, path=path)
            if repeat:
                seconds[path].append(time.perf_counter() - start)
    directory = ray.get(ranks[0].pushed_directory.remote()) if "disk" in paths else None
    row = {path: (statistics.median(seconds[path]), path_bytes(path, state, directory, served_dtype)) for path in paths}
    wait_for([rank.shutdown.remote() for rank in ranks], TIMEOUT_S, "the policy ranks to shut down")
    for rank in ranks:
        ray.kill(rank)
    manager.shutdown()
    return row


def compare_paths(args: argparse.Namespace, paths: dict[str, Callable[[], str]]) -> None:
    print(f"{RANKS} FSDP ranks (gloo), hf servers awake; medians of {args.repeats} interleaved repeats")
    print("| model | servers | path | s / push | MB received per server |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        for servers in (int(n) for n in args.servers.split(",")):
            # the 0.6B shape is served in bf16, as benchmarks.real_size serves it (four fp32 copies do not fit here)
            served = "bfloat16" if name == "real" else "float32"
            row = measure_paths(paths[name](), servers, args.paths.split(","), args.repeats, served)
            for path, (seconds, received) in row.items():
                print(f"| {name} | {servers} | {path} | {seconds:.3f} | {received / 1e6:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="tiny,medium", help="comma-separated: tiny, medium, real (0.6B shape)")
    parser.add_argument("--asleep", action="store_true", help="servers asleep during the push (KV cache freed)")
    parser.add_argument("--paths", help="compare these weight paths instead: object_store,collective,disk")
    parser.add_argument("--servers", default="1,2,4", help="with --paths: server counts")
    args = parser.parse_args()
    paths = {"tiny": tiny_model_path, "medium": medium_model_path, "real": real_size_model_path}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    if args.paths:
        compare_paths(args, paths)
        ray.shutdown()
        return
    state = "asleep" if args.asleep else "awake"
    print(
        f"{RANKS} FSDP ranks (gloo), 1 rollout server ({state}); medians of {args.repeats} repeats; "
        "baseline: torch.save(state_dict, io.BytesIO())"
    )
    print(
        "| model | params | fp32 MB | trainer's push / baseline | push through the driver / baseline | gather alone / baseline |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        row = measure(paths[name](), args.repeats, args.asleep)
        print(
            f"| {name} | {row['params_m']:.1f}M | {row['mb']:.0f} | {row['trainer']:.2f} | "
            f"{row['driver']:.2f} | {row['gather']:.2f} |",
            flush=True,
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
