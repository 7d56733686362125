"""The FSDP ranks on two CPU processes (gloo) against the real rollout stack: scores, update, weight push, checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from tests.support.config import small_config
from tests.support.ranks import manager_and_two_ranks, scores
from trainer.rollout_correction import RolloutCorrection, correct_batch

ROWS = [{"prompt": [{"role": "user", "content": f"question number {i}"}]} for i in range(4)]


@pytest.fixture(scope="module")
def setup(local_ray):
    config = small_config(
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.optim.warmup_style=cosine",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    )
    yield from manager_and_two_ranks(config)


def test_sharded_scores_match_the_engine_update_moves_them_and_the_push_keeps_them_equal(setup):
    manager, actors = setup
    batch = manager.generate_sequences(ROWS)
    mask = batch.batch["response_mask"].bool()
    old = scores(actors, batch.batch)
    # the trainer's re-scoring of the rollout equals the engine's own logprobs (no rollout/train mismatch)
    assert torch.allclose(old[mask], batch.batch["rollout_log_probs"][mask], atol=1e-4)

    advantages = torch.where(torch.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * mask
    train = batch.batch.clone()
    train["old_log_probs"], train["advantages"] = old, advantages
    halves = train.split(len(batch) // 2)
    metrics = ray.get([actor.update_policy.remote(half) for actor, half in zip(actors, halves)], timeout=120)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    new = scores(actors, batch.batch)
    gain = (new - old) * mask
    assert gain[0::2].sum() > 0 > gain[1::2].sum(), "positive advantages raise log-probs, negative ones lower them"

    # gathering is a collective: every rank takes part, rank 0 receives
    state, other = ray.get([actor.full_state_dict.remote() for actor in actors], timeout=120)
    assert state and other == {}
    manager.update_weights(state)
    fresh = manager.generate_sequences(ROWS)
    fresh_mask = fresh.batch["response_mask"].bool()
    assert torch.allclose(
        scores(actors, fresh.batch)[fresh_mask], fresh.batch["rollout_log_probs"][fresh_mask], atol=1e-4
    )


def test_checkpoint_restores_weights_optimizer_and_lr_schedule(setup, tmp_path):
    manager, actors = setup
    batch = manager.generate_sequences(ROWS)
    train = batch.batch.clone()
    train["old_log_probs"] = scores(actors, batch.batch)
    train["advantages"] = torch.ones_like(train["old_log_probs"]) * train["response_mask"]

    def update():
        halves = train.split(len(batch) // 2)
        return ray.get([actor.update_policy.remote(half) for actor, half in zip(actors, halves)], timeout=120)[0]

    def weights():
        return ray.get([actor.full_state_dict.remote() for actor in actors], timeout=120)[0]

    update()
    ray.get(
        [actor.save_checkpoint.remote(str(tmp_path / "ckpt"), str(tmp_path / "hf")) for actor in actors], timeout=120
    )
    saved = weights()
    after_save = update()
    moved = weights()
    assert any(not torch.equal(saved[k], v) for k, v in moved.items()), "the update after the save moved the weights"

    ray.get([actor.load_checkpoint.remote(str(tmp_path / "ckpt")) for actor in actors], timeout=120)
    assert all(torch.equal(saved[k], v) for k, v in weights().items())
    # same weights, Adam moments and schedule position: the next update repeats the one after the save
    assert update() == pytest.approx(after_save, rel=1e-4, abs=1e-6)
    assert all(torch.allclose(moved[k], v, atol=1e-6) for k, v in weights().items())

    # the Hugging Face export loads as an ordinary checkpoint with the saved weights
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert all(torch.equal(exported[k], v) for k, v in saved.items())


def test_update_scoring_its_own_old_log_probs_is_the_rescore_then_update_step(setup, tmp_path):
    """With one optimizer step per batch, the update's own forward passes give the old log-probs: the step
    (importance weights, loss, new weights) is the one a re-scoring pass followed by the update makes."""
    manager, actors = setup
    batch = manager.generate_sequences(ROWS)
    mask = batch.batch["response_mask"]
    train = batch.batch.clone()
    # a behaviour policy away from the current one: the importance weights vary, and some are truncated
    train["rollout_log_probs"] = train["rollout_log_probs"] + torch.linspace(-1.0, 1.0, mask.shape[1]) * mask
    train["advantages"] = torch.where(torch.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * mask
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5)

    def on_ranks(method, data, **kwargs):
        return ray.get(
            [getattr(actor, method).remote(half, **kwargs) for actor, half in zip(actors, data.split(len(data) // 2))],
            timeout=120,
        )

    def weights():
        return ray.get([actor.full_state_dict.remote() for actor in actors], timeout=120)[0]

    ray.get([actor.save_checkpoint.remote(str(tmp_path / "ckpt")) for actor in actors], timeout=120)
    rescored = train.clone()
    rescored["old_log_probs"] = scores(actors, train)
    correct_batch(rescored, correction)
    truncated = int(((rescored["rollout_is_weights"] == 1.5) & mask.bool()).sum())
    assert 0 < truncated < int(mask.sum())
    expected_metrics, expected_weights = on_ranks("update_policy", rescored), weights()

    ray.get([actor.load_checkpoint.remote(str(tmp_path / "ckpt")) for actor in actors], timeout=120)
    updates = on_ranks("update_policy_scoring_old", train, correction=correction)
    old_log_probs = torch.cat([old for _, old in updates])
    assert torch.allclose(old_log_probs * mask, rescored["old_log_probs"] * mask, atol=1e-5)
    for (metrics, _), expected in zip(updates, expected_metrics):
        assert metrics == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert all(torch.allclose(value, expected_weights[key], atol=1e-6) for key, value in weights().items())


def test_a_push_in_the_servers_dtype_is_the_policy_cast_as_it_is_gathered(setup, tmp_path):
    _, actors = setup
    state, _ = ray.get([actor.full_state_dict.remote() for actor in actors], timeout=120)
    packed, other = ray.get([actor.packed_state_dict.remote(torch.bfloat16) for actor in actors], timeout=120)
    assert other is None
    pushed = packed.tensors()
    assert set(pushed) == set(state)  # (a tied output head included, as the float32 push has it)
    for name, tensor in state.items():
        assert pushed[name].dtype == torch.bfloat16 and torch.equal(pushed[name], tensor.to(torch.bfloat16)), name
    # the disk path writes the same cast policy (the checkpoint drops the tied head, as save_pretrained does); its
    # first push removes the folders that processes of this host no longer running left (a killed rank's)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    orphaned, live, remote = (
        tmp_path / f"agentloop-push-{host}-{ended.stdout.strip()}-x-v3",
        tmp_path / f"agentloop-push-{host}-{os.getpid()}-x-v3",
        tmp_path / f"agentloop-push-{host}x-{ended.stdout.strip()}-x-v3",
    )
    for left in (orphaned, live, remote):
        left.mkdir()
    folder, other = ray.get([actor.save_for_push.remote(str(tmp_path), 1, torch.bfloat16) for actor in actors])
    assert other is None
    assert not orphaned.exists() and live.exists() and remote.exists()
    written = load_file(next(Path(folder).glob("*.safetensors")))
    assert written and all(torch.equal(written[name], pushed[name]) for name in written)
