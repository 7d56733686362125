"""Image trajectories: the same multi-turn rollouts run straight on one engine vs. through the whole stack.

    python -m benchmarks.vlm_rollout [--samples 32] [--repeats 3]

Each trajectory: a prompt with one picture, then three turns of 16 greedy tokens, each of the first two
answered by a new picture (84x84 pixels: 9 image tokens each). (a) the ``Trajectory`` code and one
``HFEngine`` (its image lane) in this process, driven with asyncio; (b) ``AgentLoopManager`` -> worker ->
agent loop -> router -> one ``RolloutServer`` with the same engine settings and CPU threads, padded into
the trainer's batch. Greedy decoding makes both paths generate the same tokens. Prints tokens/s of both
and b/a, the image processor's calls per image (counted in (a), which runs the same trajectory code as the
workers), and the bytes of image tensors per sample in the batch (dense-padded and actually used).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import ray
import torch
from PIL import Image

from agentloop import AgentLoopManager
from agentloop.agent_loop.trajectory import Trajectory
from agentloop.config import compose_config
from agentloop.images import expand_image_pads, process_images, split_images
from agentloop.models.loading import load_processor
from agentloop.models.tiny_vlm import tiny_vlm_path
from agentloop.server.hf_engine import HFEngine
from agentloop.testing import picture_turns
from agentloop.settings import rollout_settings

THREADS = 2
SPEC = {"turns": 3, "length": 16, "sizes": [[84, 84]]}


def make_rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [{"role": "user", "content": f"picture {i}: <image> what is in it?"}],
            "images": [Image.new("RGB", (84, 84), (i * 7 % 256, 30, 60))],
            "agent_name": "picture_turns",
            "extra_info": SPEC,
        }
        for i in range(count)
    ]


def config():
    return compose_config(
        [
            f"actor_rollout_ref.model.path={tiny_vlm_path()}",
            "data.max_prompt_length=64",
            "data.max_response_length=128",
            f"actor_rollout_ref.rollout.resources_per_server.CPU={THREADS}",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "actor_rollout_ref.rollout.temperature=0",
        ]
    )


class EngineAsRouter:
    """Path (a): the router's ``generate`` call answered by the in-process engine."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict[str, Any], image_data: Any = None):
        return await self.engine.generate(prompt_ids, params, request_id, images=image_data)


class Direct:
    def __init__(self, config, rows) -> None:
        self.processor = load_processor(config.actor_rollout_ref.model.path)
        self.calls = 0
        image_processor = self.processor.image_processor
        counted = type("Counted", (type(image_processor),), {"__call__": self._counting(image_processor)})
        image_processor.__class__ = counted  # count calls, process as before
        self.rows = rows
        torch.set_num_threads(THREADS)
        self.engine = HFEngine.from_settings(rollout_settings(config).servers, rank=0)
        self.router = EngineAsRouter(self.engine)
        self.params = {"temperature": 0.0}
        self.loop = asyncio.new_event_loop()  # the engine serves one event loop (as in its rollout server)

    def _counting(self, image_processor: Any):
        original = type(image_processor).__call__

        def call(processor: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(processor, *args, **kwargs)

        return call

    def trajectory(self, row: dict[str, Any]) -> Trajectory:
        tokenizer = self.processor.tokenizer
        messages, images = split_images(row["prompt"], row["images"], "row")
        processed = process_images(self.processor, images, "row")
        pad = tokenizer.convert_tokens_to_ids(self.processor.image_token)
        ids = expand_image_pads(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False),
            processed,
            pad,
            "row",
        )
        return Trajectory(tokenizer, messages, ids, None, processor=self.processor, images=processed)

    def run(self) -> tuple[int, float]:
        async def run_all():
            return await asyncio.gather(
                *(
                    picture_turns(self.trajectory(row), self.router, f"r{i}-{time.monotonic()}", self.params, SPEC)
                    for i, row in enumerate(self.rows)
                )
            )

        start = time.perf_counter()
        outputs = self.loop.run_until_complete(run_all())
        return sum(sum(output.response_mask) for output in outputs), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = make_rows(args.samples)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    direct = Direct(config(), rows)
    manager = AgentLoopManager(config())
    try:
        direct.run(), manager.generate_sequences(rows)  # warm-up
        direct.calls = 0
        direct_rates, stack_rates = [], []
        for _ in range(args.repeats):
            tokens, seconds = direct.run()
            direct_rates.append(tokens / seconds)
            start = time.perf_counter()
            batch = manager.generate_sequences(rows)
            seconds = time.perf_counter() - start
            stack_tokens = int(batch.batch["response_mask"].sum())
            assert stack_tokens == tokens, (stack_tokens, tokens)
            stack_rates.append(stack_tokens / seconds)
    finally:
        manager.shutdown()
        direct.loop.run_until_complete(direct.engine.shutdown())
    images = args.samples * SPEC["turns"] * args.repeats  # one in the prompt, one per observation
    pixels, grids = batch.batch["pixel_values"], batch.batch["image_grid_thw"]
    used = int(grids.prod(-1).sum()) * pixels.shape[-1] * pixels.element_size() + grids.numel() * grids.element_size()
    padded = pixels.numel() * pixels.element_size() + grids.numel() * grids.element_size()
    direct_rate, stack_rate = statistics.median(direct_rates), statistics.median(stack_rates)
    print(f"samples: {args.samples}, generated tokens per run: {tokens}, repeats: {args.repeats}")
    print(f"(a) engine in-process: {direct_rate:9.1f} tokens/s (median)")
    print(f"(b) through the stack: {stack_rate:9.1f} tokens/s (median)")
    print(f"ratio b/a: {stack_rate / direct_rate:.3f}")
    print(f"image processor calls per image (a): {direct.calls / images:.2f} ({direct.calls} calls, {images} images)")
    print(
        f"image tensor bytes per sample in the batch: {padded / len(batch):.0f} dense-padded, {used / len(batch):.0f} used"
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
