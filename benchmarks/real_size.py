"""A model of real size on CPU: a Qwen3-0.6B-shaped policy trained with the quick start's loop.

    python -m benchmarks.real_size [--steps 2] [--variants checkpointing,lora] [--layers 28] [--model tiny]

The policy has Qwen3-0.6B's shape (28 layers 1024 wide, 16 query and 8 key-value heads of 128, MLP 3072, the
151,936-token vocabulary, tied embeddings: 596M parameters) with random weights (no hub here) and the tiny model's
tokenizer, which decodes only the first 1,024 ids: the reward is 0 throughout, and what is measured is cost. Each
variant runs the arithmetic quick start (``--config-name arithmetic_grpo``: tool agent, GRPO, the ``hf`` engine) for
``--steps`` steps on a simulated two-node Ray cluster, one FSDP rank on each node, one rollout server, and reports
per rank the peak resident memory (the process's high-water mark), seconds per step and its parts, the weight push,
and the size and seconds of one checkpoint (saved after the last step). Variants differ in the ranks' memory
settings (gradient checkpointing; the optimizer state offloaded; bf16 compute, ``mixed``) or train LoRA adapters
instead of the weights (``lora``: the size of each push is the adapter's). The default pair, full weights beside
LoRA in one run, is issue 51's comparison. ``--layers`` keeps the widths and vocabulary at a smaller depth, for a
machine whose memory does not hold full-weight training at 28 layers. Absolute seconds vary with the machine's
load: compare variants within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.cluster_utils import Cluster

from agentloop.config import compose_config
from agentloop.models.tiny_qwen import tiny_model_path
from benchmarks.models import scaled_tiny_model
from trainer.ray_trainer import RayPPOTrainer

TIMINGS = ("timing_s/step", "timing_s/gen", "timing_s/train", "timing_s/weight_push")
VARIANTS = {
    "default": [],
    "checkpointing": ["actor_rollout_ref.model.enable_gradient_checkpointing=true"],
    "offload": [
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    ],
    # bf16 compute in the ranks (FSDP2's MixedPrecisionPolicy), the weights and AdamW's state kept fp32
    "mixed": [
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}",
    ],
    # LoRA instead of full weights (docs/guides/lora.md): rank 16 on every linear layer
    "lora": ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"],
}


def real_size_model_path(layers: int = 28) -> str:
    """The Qwen3-0.6B-shaped model, built once into the agentloop cache (bf16 on disk, as Qwen3-0.6B ships);
    ``layers`` below 28: the same widths and vocabulary at that depth (14: 375M parameters)."""
    return scaled_tiny_model(
        "qwen3-0.6b-shaped-v1" if layers == 28 else f"qwen3-0.6b-shaped-{layers}-layers-v1",
        torch.bfloat16,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    )


def overrides(model_path: str, steps: int, output_dir: Path) -> list[str]:
    """The quick start, smaller per step (2 prompts x 2 samples, 2 turns of 32 tokens), on two nodes' ranks."""
    return [
        f"actor_rollout_ref.model.path={model_path}",
        "~task.prepare.warm_start",
        "data.val_files=null",
        "data.train_batch_size=2",
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.response_length=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        # the hf engine's KV cache is sized in pages: the default 1,024 of 16 tokens hold 3.7 GB at this shape (28
        # layers x 8 key-value heads x 128 x 2 x fp32 per token); 128 pages hold this run's 4 trajectories
        "actor_rollout_ref.rollout.hf.num_blocks=128",
        # the server in bf16 (1.2 GB of weights instead of 2.4): with two fp32 ranks beside it, 24 GB run out otherwise
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=2",
        "trainer.resources_per_rank={trainer_node: 1}",
        f"trainer.total_training_steps={steps}",
        "trainer.rollout_data_dir=null",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={output_dir}",
    ]


def peak_rss_gb(actor: ray.actor.ActorHandle) -> float:
    """The process's resident-memory high-water mark (Linux reports KiB)."""
    return ray.get(actor.__ray_call__.remote(lambda _: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)) / 2**20


def push_mb(rank: ray.actor.ActorHandle, served: torch.dtype) -> float:
    """The size of each push: every parameter in the servers' dtype (each cast as it is gathered), or the adapter
    only, as it trains (global sizes of the sharded parameters; a tied weight counted once)."""

    def size(worker: Any) -> int:
        trained = [p for p in worker.policy.model.parameters() if p.requires_grad]  # (unique parameters)
        if worker.lora is not None:
            return sum(p.numel() * p.element_size() for p in trained)
        return sum(p.numel() for p in trained) * served.itemsize

    return ray.get(rank.__ray_call__.remote(size)) / 1e6


def directory_gb(path: Path) -> float:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) / 2**30


def run_variant(name: str, model_path: str, steps: int, output_dir: Path) -> dict[str, Any]:
    """One variant's run, on a two-node cluster of its own (a rank per node, the server and driver on the head)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"trainer_node": 1}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=0, resources={"trainer_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        config = compose_config([*overrides(model_path, steps, output_dir), *VARIANTS[name]], "arithmetic_grpo")
        trainer = RayPPOTrainer(config)
        try:
            lines = trainer.fit()
            start = time.perf_counter()
            trainer.save_checkpoint(steps)
            save_s = time.perf_counter() - start
            peaks = [peak_rss_gb(rank) for rank in trainer.workers]
            server_peak = peak_rss_gb(trainer.manager.servers[0])
            pushed_mb = push_mb(trainer.workers[0], getattr(torch, config.actor_rollout_ref.rollout.dtype))
        finally:
            trainer.shutdown(60.0)
    finally:
        ray.shutdown()
        cluster.shutdown()
    later = lines[1:] or lines  # the first step also warms up
    median = {key: statistics.median(line[key] for line in later) for key in TIMINGS}
    return {
        "rank_peak_rss_gb": [round(peak, 2) for peak in peaks],
        "server_peak_rss_gb": round(server_peak, 2),
        "startup_s": round(lines[0]["timing_s/startup"], 1),
        **{key.removeprefix("timing_s/") + "_s": round(value, 2) for key, value in median.items()},
        "push_mb": round(pushed_mb, 1),
        "checkpoint_gb": round(directory_gb(output_dir / f"global_step_{steps}"), 2),
        "checkpoint_s": round(save_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default="checkpointing,lora")
    parser.add_argument("--output", default="outputs/bench_real_size")
    parser.add_argument("--model", choices=("real", "tiny"), default="real", help="tiny: a quick run of this script")
    parser.add_argument("--layers", type=int, default=28, help="the real model's depth (28: Qwen3-0.6B's)")
    args = parser.parse_args()
    model_path = real_size_model_path(args.layers) if args.model == "real" else tiny_model_path()
    for name in args.variants.split(","):
        try:
            result = run_variant(name, model_path, args.steps, Path(args.output) / name)
        except Exception as error:  # (an out-of-memory kill is a result too: the next variant still runs)
            result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(json.dumps({name: result}), flush=True)


if __name__ == "__main__":
    main()
