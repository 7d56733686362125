"""One sample's failure stays its own: the batch comes back complete, the failed sample empty, untrained and
explained, up to rollout.max_failed_sample_ratio; past it the call fails with the first traceback."""

from __future__ import annotations

import pytest
import torch

from agentloop import AgentLoopManager
from agentloop.protocol import Failure
from tests.support.config import small_config
from trainer import algorithms
from trainer.ray_trainer import grpo_groups


@pytest.fixture(scope="module")
def manager(local_ray):
    import tests.support.probe_loops  # noqa: F401  (registers probe_fails)

    manager = AgentLoopManager(
        small_config("actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.max_failed_sample_ratio=0.5")
    )
    yield manager
    manager.shutdown()


def rows(*fail: bool | str) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "agent_name": "probe_fails",
            "extra_info": {"index": i, "fail": f},
        }
        for i, f in enumerate(fail)
    ]


def test_a_failing_sample_comes_back_marked_and_empty(manager):
    batch = manager.generate_sequences(rows(False, True))
    assert len(batch) == 4
    fields = batch.non_tensor_batch
    failed = [i for i, failure in enumerate(fields["failure"]) if failure is not None]
    assert failed == [2, 3]  # both samples of row 1, in row order
    for i in failed:
        assert fields["end_reason"][i] == "failed"
        assert fields["failure"][i].error == "ValueError: probe bug on dataset index 1"
        assert "Traceback" in fields["failure"][i].traceback and "probe_loops.py" in fields["failure"][i].traceback
        assert batch.batch["response_mask"][i].sum() == 0 and batch.batch["rm_scores"][i].sum() == 0
    assert batch.batch["response_mask"][:2].sum() > 0
    assert batch.meta_info["rollout/failed_samples"] == 2 and batch.meta_info["multi_turn/finish_reason/failed"] == 2
    # the probe is a user loop that reports no end reason and no turns: the defaults, counted as unknown
    assert list(fields["end_reason"][:2]) == [None, None] and list(fields["turns"][:2]) == [[], []]
    assert batch.meta_info["multi_turn/finish_reason/unknown"] == 2 and batch.meta_info["tool_call_counts/max"] == 0


def test_a_reward_the_batch_would_drop_fails_its_sample_instead(manager):
    batch = manager.generate_sequences(rows(False, "empty_last_segment"))
    fields = batch.non_tensor_batch
    assert [failure is None for failure in fields["failure"]] == [True, True, False, False]
    for i in (2, 3):
        assert "reward 1.0 has no response token to sit on: its last segment (of 2)" in fields["failure"][i].error
    # what the batch holds of each sample's reward is all of it
    rewards = [float(score or 0.0) for score in fields["reward_score"]]
    assert batch.batch["rm_scores"].sum(dim=1).tolist() == rewards


def test_past_the_ratio_the_call_fails_with_the_first_traceback(manager):
    with pytest.raises(
        RuntimeError,
        match=r"(?s)4 of 4 samples failed, more than .*max_failed_sample_ratio=0.5.*probe bug on dataset index 0",
    ):
        manager.generate_sequences(rows(True, True))


def test_a_failed_sample_leaves_its_grpo_group(manager):
    import uuid

    batch = manager.generate_sequences(rows(False, False))
    # one sample of group 0 fails (marked as the worker marks it); its partner is alone in the group now
    batch.non_tensor_batch["end_reason"][1], batch.non_tensor_batch["failure"][1] = "failed", Failure("x", "x")
    batch.non_tensor_batch["uid"][:] = [str(uuid.uuid4())] * 4  # one group of four: three left after the failure
    groups = grpo_groups(batch)
    assert len(set(groups)) == 2 and groups[1] not in (groups[0], groups[2]) and groups[0] == groups[2] == groups[3]
    scores = torch.tensor([[1.0], [0.0], [0.0], [2.0]])  # a failed sample scores 0 (no reward, no response)
    advantages, _ = algorithms.grpo_outcome_advantage(scores, torch.ones(4, 1), groups)
    assert advantages[1, 0] == 0
    assert torch.allclose(advantages[[0, 2, 3], 0], (scores[[0, 2, 3], 0] - 1) / (scores[[0, 2, 3], 0].std() + 1e-6))
