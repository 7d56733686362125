"""Training on segments (a trajectory whose context was rewritten has one batch row per segment): GRPO and GAE per
trajectory, whole trajectories per rank and mini-batch, stand-in micro-batches on ranks with fewer rows, and
single-segment batches cut exactly as before. Batches are made by hand (``pad_outputs`` of ``AgentLoopOutput``s)."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from agentloop.batch import RolloutBatch, object_array
from agentloop.postprocess import pad_outputs
from agentloop.protocol import AgentLoopOutput, Segment
from tests.support.config import small_config
from tests.support.ranks import two_ranks
from trainer import algorithms
from trainer.fsdp_workers import policy_gradient_loss, response_log_probs
from trainer.ray_trainer import grpo_groups
from trainer.micro_batches import MicroBatching, balanced_groups, bins_needed, split_trajectories, trajectory_sizes
from trainer.rank_settings import ActorSettings, OptimSettings, UpdateSettings
from trainer.rollout_correction import RolloutCorrection
from trainer.trainable import Trainable

PROMPT, RESPONSE, PAD = 8, 8, 0


def segment(rng: random.Random, prompt: int, mask: list[int]) -> Segment:
    """A segment of random token ids: ``prompt`` context tokens, then a response with this mask."""
    return Segment(
        [rng.randrange(1, 1000) for _ in range(prompt)],
        [rng.randrange(1, 1000) for _ in mask],
        mask,
        [-0.5 if m else 0.0 for m in mask],
    )


def trajectory(rng: random.Random, masks: list[list[int]], reward: float) -> AgentLoopOutput:
    """A trajectory of one segment per response mask (earlier ones in ``segments``), ``reward`` on its last."""
    *earlier, last = [segment(rng, rng.randrange(2, PROMPT + 1), mask) for mask in masks]
    return AgentLoopOutput(
        last.prompt_ids,
        last.response_ids,
        last.response_mask,
        last.response_logprobs,
        reward_score=reward,
        segments=earlier,
        rewritten_by="summary" if earlier else None,
    )


def rollout(outputs: list[AgentLoopOutput], uids: list[str]) -> RolloutBatch:
    """The padded batch, with each trajectory's ``uid`` and ``failure`` on every one of its rows, as the worker pads them."""
    repeats = [len(output.all_segments()) for output in outputs]

    def column(values: list) -> np.ndarray:
        return object_array([value for value, count in zip(values, repeats) for _ in range(count)])

    fields = {"uid": column(uids), "failure": column([None] * len(outputs))}
    return RolloutBatch(pad_outputs(outputs, PROMPT, RESPONSE, PAD), fields)


def test_grpo_scores_each_trajectory_once_and_puts_its_advantage_on_every_segment():
    rng = random.Random(0)
    masks = {  # model tokens per trajectory: A 2 + 2 + 3 = 7 over 3 segments, B 2, C 2, D 1 + 2 = 3
        "A": [[1, 1, 0], [1, 0, 1], [1, 1, 1]],
        "B": [[1, 1]],
        "C": [[1, 0, 1]],
        "D": [[1], [0, 1, 1]],
    }
    rewards = {"A": 1.0, "B": 0.0, "C": 0.5, "D": 2.0}
    outputs = [trajectory(rng, masks[name], rewards[name]) for name in "ABCD"]
    batch = rollout(outputs, ["g1", "g1", "g2", "g2"])
    segment_index = batch.batch["segment_index"]
    assert segment_index.tolist() == [0, 1, 2, 0, 0, 0, 1]
    assert grpo_groups(batch) == ["g1", "g1", "g2", "g2"], "one group entry per trajectory"
    mask = batch.batch["response_mask"].float()
    # the KL-in-reward penalty sits on every row's model tokens; the reward only on each trajectory's last row
    token_rewards = batch.batch["rm_scores"] - 0.1 * mask
    advantages, _ = algorithms.grpo_outcome_advantage(
        token_rewards, mask, grpo_groups(batch), segment_index=segment_index
    )

    scores = {"A": 1.0 - 0.1 * 7, "B": 0.0 - 0.1 * 2, "C": 0.5 - 0.1 * 2, "D": 2.0 - 0.1 * 3}
    expected = {}
    for group in ("AB", "CD"):
        values = [scores[name] for name in group]
        mean, std = statistics.mean(values), statistics.stdev(values)
        expected.update({name: (scores[name] - mean) / (std + 1e-6) for name in group})
    rows = {"A": [0, 1, 2], "B": [3], "C": [4], "D": [5, 6]}
    for name, indices in rows.items():
        for row in indices:
            torch.testing.assert_close(advantages[row], expected[name] * mask[row])
    assert advantages[0].abs().sum() > 0 and advantages[1].abs().sum() > 0, "earlier segments carry the advantage too"


def test_gae_over_segments_is_gae_over_the_concatenated_response():
    rng = random.Random(1)
    outputs = [
        trajectory(rng, [[1, 1, 0, 1], [0, 1, 1], [1, 0, 0, 1, 1]], 1.0),
        trajectory(rng, [[1, 1, 1, 0, 1]], -0.5),
    ]
    batch = pad_outputs(outputs, PROMPT, RESPONSE, PAD)
    generator = torch.Generator().manual_seed(0)
    mask = batch["response_mask"].double()
    values = torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    rewards = batch["rm_scores"].double()
    rewards[0, 2] = 0.3  # a step reward on an observation token of an earlier segment
    rewards[1, 0] = -0.2  # and one on a later segment's first token
    advantages, returns = algorithms.gae_advantage_return(rewards, values, mask, 0.9, 0.8, batch["segment_index"])

    # the same trajectories as single rows: the first one's three response rows side by side, the second padded
    def concatenated(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[:3].flatten(), torch.cat([x[3], torch.zeros(2 * RESPONSE, dtype=x.dtype)])])

    whole_advantages, whole_returns = algorithms.gae_advantage_return(
        concatenated(rewards), concatenated(values), concatenated(mask), 0.9, 0.8
    )
    torch.testing.assert_close(concatenated(advantages), whole_advantages)
    torch.testing.assert_close(concatenated(returns), whole_returns)
    # the TD step crosses segments: the first segment's advantages see the reward at the end of the third
    alone, _ = algorithms.gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    assert not torch.allclose(alone[0], advantages[0])


def test_single_segment_batches_are_cut_and_scored_exactly_as_before():
    rng = random.Random(2)
    lengths = [[1] * rng.randrange(1, RESPONSE + 1) for _ in range(12)]
    batch = pad_outputs(
        [trajectory(rng, [mask], float(i % 3)) for i, mask in enumerate(lengths)], PROMPT, RESPONSE, PAD
    )
    assert trajectory_sizes(batch) == [1] * 12
    for count in (1, 3, 4, 5, 12):  # ranks' slices and mini-batches: ``batch.split(count)`` before
        for part, before in zip(split_trajectories(batch, count), batch.split(count), strict=True):
            assert (part == before).all()
    for size in (1, 2, 5, 12, 20):  # fixed micro-batches: consecutive runs of ``size`` rows before
        assert MicroBatching(size).groups(batch) == [
            list(range(start, min(start + size, 12))) for start in range(0, 12, size)
        ]
    tokens = batch["attention_mask"].sum(-1).tolist()
    for budget in (16, 24, 40):  # token-packed micro-batches
        packed = MicroBatching(1, dynamic=True, max_tokens=budget)
        assert packed.groups(batch) == balanced_groups(tokens, bins_needed(tokens, budget))

    mask, segment_index = batch["response_mask"].float(), batch["segment_index"]
    rewards, values = batch["rm_scores"], torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    groups = [str(row // 3) for row in range(12)]
    before = algorithms.grpo_outcome_advantage(rewards, mask, groups)
    after = algorithms.grpo_outcome_advantage(rewards, mask, groups, segment_index=segment_index)
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    before = algorithms.gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    after = algorithms.gae_advantage_return(rewards, values, mask, 0.9, 0.8, segment_index)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_fixed_micro_batches_keep_a_trajectorys_rows_together_where_they_fit():
    rng = random.Random(3)
    outputs = [trajectory(rng, [[1]] * count, 0.0) for count in (2, 3, 1, 5, 1)]
    batch = pad_outputs(outputs, PROMPT, RESPONSE, PAD)
    assert trajectory_sizes(batch) == [2, 3, 1, 5, 1]
    assert [len(part) for part in split_trajectories(batch, 2)] == [5, 6, 1]
    # rows 0-1 | 2-4 | 5 | 6-8, 9-10 (a trajectory longer than a micro-batch fills its own), with 11 after it
    assert MicroBatching(3).groups(batch) == [[0, 1], [2, 3, 4], [5], [6, 7, 8], [9, 10, 11]]


def test_a_segmented_trajectory_trains_as_independent_rows_with_its_advantage(model_path):
    """The update's gradient (token-mean PPO loss) is the sum over every row's model tokens, each row scored in its
    own context, with the trajectory's advantage: whatever the micro-batches, a 2-segment trajectory is its rows."""
    rng = random.Random(4)
    outputs = [trajectory(rng, [[1, 1, 0, 1], [1, 0, 1, 1, 1]], 1.0), trajectory(rng, [[1, 1, 1]], 0.0)]
    data = rollout(outputs, ["g", "g"])
    batch = data.batch
    mask = batch["response_mask"].float()
    batch["advantages"], _ = algorithms.grpo_outcome_advantage(
        batch["rm_scores"], mask, grpo_groups(data), segment_index=batch["segment_index"]
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        batch["old_log_probs"] = response_log_probs(model, batch, 1.0)[0]

    # by hand: each row on its own, -A x ratio summed over its model tokens, over all the batch's model tokens
    expected_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)

    def row_loss(row: int) -> torch.Tensor:
        ratio = (
            response_log_probs(expected_model, batch[row : row + 1], 1.0)[0][0] - batch["old_log_probs"][row]
        ).exp()
        return (-batch["advantages"][row] * ratio * mask[row]).sum()

    total = sum(row_loss(row) for row in range(len(batch))) / mask.sum()
    total.backward()
    expected = [parameter.grad for parameter in expected_model.parameters()]

    actor = ActorSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)  # token-mean
    for size in (1, 2, 3):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        trainable = Trainable(model, OptimSettings(lr=1e-4), total_steps=1, role="actor")

        def loss(micro: TensorDict) -> tuple[torch.Tensor, dict]:
            log_probs, _ = response_log_probs(model, micro, 1.0)
            value, _, stats = policy_gradient_loss(micro, log_probs, actor, RolloutCorrection())
            return value, stats

        update = UpdateSettings(micro_batching=MicroBatching(size), grad_clip=1e9)
        trainable.update(batch, update, 2, loss)
        for want, parameter in zip(expected, model.parameters()):  # Adam's first moment after one step: 0.1 x gradient
            torch.testing.assert_close(
                trainable.optimizer.state[parameter]["exp_avg"] / 0.1, want, rtol=1e-4, atol=1e-6
            )


@pytest.fixture(scope="module")
def ranks(local_ray):
    config = small_config(
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "trainer.step_timeout_s=120",  # a rank left waiting in a collective fails, rather than hanging the test
    )
    yield from two_ranks(config)


def test_ranks_with_different_row_counts_score_and_update_in_step(ranks):
    """Rank 0's trajectories have 3 segments (6 rows: 4 micro-batches of at most 2), rank 1's one (2 rows: 1, then 3
    stand-ins): the passes stay in lock step, the stand-ins change no score, and the update moves the policy."""
    rng = random.Random(5)
    masks = [[1, 1, 0, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1, 1, 1]]
    outputs = [trajectory(rng, masks, 1.0) for _ in range(2)] + [trajectory(rng, masks[:1], 0.0) for _ in range(2)]
    batch = pad_outputs(outputs, PROMPT, RESPONSE, PAD)
    shards = split_trajectories(batch, 2)
    assert [len(shard) for shard in shards] == [6, 2]

    def on_ranks(method: str, parts: list[TensorDict], **kwargs) -> list:
        return ray.get(
            [getattr(worker, method).remote(part, **kwargs) for worker, part in zip(ranks, parts)], timeout=300
        )

    old = torch.cat(on_ranks("compute_log_prob", shards))
    swapped = on_ranks("compute_log_prob", shards[::-1])  # the other rank, other micro-batches: the same scores
    torch.testing.assert_close(torch.cat(swapped[::-1]), old, rtol=1e-5, atol=1e-5)

    mask = batch["response_mask"].bool()
    train = batch.clone()
    train["advantages"] = torch.where(torch.arange(len(batch))[:, None] < 6, 1.0, -1.0) * mask
    updates = on_ranks("update_policy_scoring_old", split_trajectories(train, 2), correction=RolloutCorrection())
    # the update's own forward passes gave the old log-probs, a stand-in's none
    torch.testing.assert_close(torch.cat([scored for _, scored in updates])[mask], old[mask], rtol=1e-5, atol=1e-5)
    assert all(metrics["actor/grad_norm"] > 0 for metrics, _ in updates)
    gain = (torch.cat(on_ranks("compute_log_prob", shards)) - old) * mask
    assert gain[:6].sum() > 0 > gain[6:].sum(), "positive advantages raise log-probs, negative ones lower them"
