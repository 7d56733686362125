"""Context strategies: training tokens and step time per trajectory against the number of turns.

    python -m benchmarks.context [--turns 8 16 32] [--samples 8] [--window 2] [--repeats 3] [overrides ...]

``env_agent`` against ``NextStepEnv`` (the same short observation at every step, never done: ``rollout.env.max_turns``
sets the turns) on the tiny default model, the loops run in this process through a ``Router`` to one ``RolloutServer``:
the manager's sampling settings have no stop ids. The tiny model's weights are random and greedy decoding's first token
is a newline in every context here, so ``stop_token_ids`` ends each turn on it: one model token per turn, which the
ChatML template re-renders exactly (a turn of sampled random tokens often re-tokenizes otherwise, and would split
``inference_template``'s contexts because of the model, not of the strategy).

Each strategy's trajectories are padded into the trainer's batch (``pad_outputs``: one row per segment, responses to
the longest segment's, the ``rollout.response_length`` that fits them). Per trajectory: rows, attended tokens
(``attention_mask``), model tokens (``response_mask``), padded tokens (what the forward passes run over), and the step
time: one forward and backward of the tiny model over the batch in the trainer's micro-batches
(``actor.ppo_micro_batch_size_per_gpu`` rows, left padding trimmed by ``trainer.vision.model_inputs``; loss: minus the
mean log-prob of the model tokens; one CPU thread) divided by the trajectories, best of ``--repeats`` with the batches
interleaved (other jobs only ever add time). ``naive`` is what segments avoid: one row per model turn holding its whole
context (prompt and every turn before it), cut from the same ``append`` trajectories. Prints each figure's ratio to
``append`` at the same turns, then per strategy the growth from the fewest turns to the most and the tokens each turn
adds between successive turn counts (constant when linear).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import ray
import torch
from omegaconf import DictConfig
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from agentloop.agent_loop.env_agent import EnvAgentLoop
from agentloop.allocator import keep_freed_memory
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.config import compose_config
from agentloop.preparation import prepare
from agentloop.dumps import mask_runs
from agentloop.envs import BaseEnv
from agentloop.postprocess import pad_outputs
from agentloop.protocol import AgentLoopOutput
from agentloop.router import Router
from agentloop.server.rollout_server import RolloutServer
from agentloop.settings import rollout_settings
from trainer.fsdp_workers import response_log_probs
from trainer.micro_batches import MicroBatching
from trainer.settings import rank_settings
from trainer.vision import model_inputs

THREADS = 1  # on a shared 2-core machine two threads each wait on the other's barriers: times spread 5-10x
PROMPT = [{"role": "user", "content": "a long task: take one small step per turn and report it"}]
OBSERVATION = "step done; reply in one short line."
STRATEGIES = ("append", "inference_template", "sliding_window")


class NextStepEnv(BaseEnv):
    """Never done: every step answers with the same short observation."""

    def step(self, response_text: str) -> tuple[str, bool, dict]:
        return OBSERVATION, False, {}


@dataclass
class Figures:
    """Per trajectory: batch rows, attended tokens, model tokens, tokens the forward passes run over (padding
    included) and step seconds."""

    rows: float
    tokens: float
    model_tokens: float
    padded: float
    seconds: float


def config(
    response_length: int, strategy: str = "append", turns: int = 1, window: int = 2, overrides: tuple[str, ...] = ()
) -> DictConfig:
    return prepare(
        compose_config(
            [
                "data.max_prompt_length=64",
                f"data.max_response_length={response_length}",
                f"actor_rollout_ref.rollout.resources_per_server.CPU={THREADS}",
                "actor_rollout_ref.rollout.env.class_name=benchmarks.context.NextStepEnv",
                f"actor_rollout_ref.rollout.env.max_turns={turns}",
                f"actor_rollout_ref.rollout.multi_turn.context.strategy={strategy}",
                f"actor_rollout_ref.rollout.multi_turn.context.window_turns={window}",
                *overrides,
            ]
        )
    )


async def rollout(
    server: ray.actor.ActorHandle, tokenizer: PreTrainedTokenizerBase, loop_config: DictConfig, samples: int, tag: str
) -> list[AgentLoopOutput]:
    router = Router([server])
    params = {"temperature": 0.0, "stop_token_ids": tokenizer.encode("\n")}
    loops = [EnvAgentLoop(server_manager=router, tokenizer=tokenizer, config=loop_config) for _ in range(samples)]
    runs = (loop.run(dict(params), prompt=PROMPT, request_id=f"{tag}-{i}") for i, loop in enumerate(loops))
    return await asyncio.gather(*runs)


def naive_rows(outputs: list[AgentLoopOutput]) -> list[AgentLoopOutput]:
    """One row per model turn of each one-segment trajectory: its whole context, then that turn (mask 1 on it only)."""
    rows = []
    for output in outputs:
        assert not output.segments, "naive rows are cut from one-segment trajectories"
        for value, start, end in mask_runs(output.response_mask):
            if value == 1:
                mask = [0] * start + [1] * (end - start)
                rows.append(AgentLoopOutput(output.prompt_ids, output.response_ids[:end], mask, [0.0] * end))
    return rows


def padded(outputs: list[AgentLoopOutput], prompt_length: int, pad_id: int) -> TensorDict:
    """The trainer's batch of these outputs, responses padded to the longest segment's."""
    longest = max(len(segment.response_ids) for output in outputs for segment in output.all_segments())
    return pad_outputs(outputs, prompt_length, longest, pad_id)


def figures(batch: TensorDict, trajectories: int, micro_batching: MicroBatching, seconds: float) -> Figures:
    padded = sum(model_inputs(micro)["input_ids"].numel() for micro in micro_batching.split(batch, "cpu"))
    return Figures(
        len(batch) / trajectories,
        float(batch["attention_mask"].sum()) / trajectories,
        float(batch["response_mask"].sum()) / trajectories,
        padded / trajectories,
        seconds / trajectories,
    )


def step_seconds(model: torch.nn.Module, batch: TensorDict, micro_batching: MicroBatching) -> float:
    """Wall time of one forward and backward over ``batch`` in micro-batches, gradients accumulated."""
    start = time.perf_counter()
    for micro in micro_batching.split(batch, "cpu"):
        log_probs, _ = response_log_probs(model, micro, temperature=1.0)
        mask = micro["response_mask"].float()
        (-(log_probs * mask).sum() / mask.sum().clamp(min=1.0)).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--window", type=int, default=2, help="sliding_window's window_turns")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"
    )
    args = parser.parse_args()
    turns = sorted(args.turns)
    base = config(64, overrides=tuple(args.overrides))
    tokenizer = AutoTokenizer.from_pretrained(base.actor_rollout_ref.model.path)
    observation = len(observation_delta(tokenizer, [NextStepEnv().format_observation(OBSERVATION)]))
    # a segment holds at most every turn: its model token, the eos that closes it and the observation
    response_length = turns[-1] * (observation + 2)
    prompt_length = int(base.actor_rollout_ref.rollout.prompt_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False))

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    server = RolloutServer.remote(rollout_settings(base).servers, 0)
    ray.get(server.__ray_ready__.remote(), timeout=600)
    batches: dict[tuple[int, str], TensorDict] = {}
    start = time.perf_counter()
    try:
        asyncio.run(rollout(server, tokenizer, base, 1, "warm-up"))
        for count in turns:
            for strategy in STRATEGIES:
                loop_config = config(response_length, strategy, count, args.window, tuple(args.overrides))
                outputs = asyncio.run(rollout(server, tokenizer, loop_config, args.samples, f"{strategy}-{count}"))
                ends = {(output.end_reason, len(output.turns)) for output in outputs}
                assert ends == {("max_turns", count)}, f"{strategy}, {count} turns: trajectories ended {ends}"
                batches[count, strategy] = padded(outputs, prompt_length, pad_id)
                if strategy == "append":
                    batches[count, "naive"] = padded(naive_rows(outputs), prompt_length, pad_id)
    finally:
        ray.kill(server)
        ray.shutdown()
    rollout_s = time.perf_counter() - start

    torch.set_num_threads(THREADS)
    keep_freed_memory()  # as the trainer's ranks do: without it a batch timed after a smaller one page-faults anew
    model = AutoModelForCausalLM.from_pretrained(base.actor_rollout_ref.model.path, dtype=torch.float32).train()
    micro_batching = rank_settings(base).actor.update.micro_batching
    step_seconds(model, batches[turns[0], "append"], micro_batching)  # warm-up
    times: dict[tuple[int, str], list[float]] = {key: [] for key in batches}
    for _ in range(args.repeats):
        for key, batch in batches.items():
            times[key].append(step_seconds(model, batch, micro_batching))
    results = {key: figures(batch, args.samples, micro_batching, min(times[key])) for key, batch in batches.items()}

    names = (*STRATEGIES, "naive")
    print(
        f"samples: {args.samples}; a turn: 1 model token, then eos and {observation} observation tokens; "
        f"prompt {prompt} tokens; window_turns {args.window}; "
        f"micro-batches of {micro_batching.size} rows; rollouts {rollout_s:.0f} s"
    )
    print(
        f"{'turns':>5} {'strategy':<19} {'rows':>6} {'tokens':>8} {'model':>6} {'padded':>8} {'tokens/append':>13} "
        f"{'ms':>8} {'time/append':>11}"
    )
    for count in turns:
        append = results[count, "append"]
        for name in names:
            result = results[count, name]
            print(
                f"{count:5d} {name:<19} {result.rows:6.1f} {result.tokens:8.1f} {result.model_tokens:6.1f} "
                f"{result.padded:8.0f} {result.tokens / append.tokens:13.2f} {1000 * result.seconds:8.2f} "
                f"{result.seconds / append.seconds:11.2f}"
            )
    if len(turns) > 1:
        low, high = turns[0], turns[-1]
        steps = ", ".join(f"{a}->{b}" for a, b in zip(turns, turns[1:]))
        print(f"growth {low} -> {high} turns (x{high / low:.1f}); tokens each turn adds, {steps}:")
        for name in names:
            first, last = results[low, name], results[high, name]
            slopes = [(results[b, name].tokens - results[a, name].tokens) / (b - a) for a, b in zip(turns, turns[1:])]
            print(
                f"  {name:<19} tokens x{last.tokens / first.tokens:5.2f}, time x{last.seconds / first.seconds:5.2f}; "
                f"per turn {', '.join(f'{slope:.1f}' for slope in slopes)}"
            )


if __name__ == "__main__":
    main()
