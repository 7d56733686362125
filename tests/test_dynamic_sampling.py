"""Dynamic sampling and overlong handling (DAPO): the group filter, the soft overlong penalty and the overlong mask
against hand-computed values; then real training runs on the coin model (its GRPO groups are often all-yes or
all-no): synchronously, no trained batch holds a group whose metric does not vary, the generation batches add up and
the checkpoint's data position counts them, the penalty is in every trained score, a step left with no group skips
its update and the next one trains, length-ended trajectories train nothing; asynchronously, the same filter holds
and no sample lags more than ``async_training.max_staleness`` versions."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from agentloop.batch import RolloutBatch, object_array
from agentloop.config import compose_config
from agentloop.dumps import read_rollout_dump
from agentloop.rows import write_rows
from tests.support.config import small_config
from tests.test_async_training import fit
from trainer.config_checks import check_config
from trainer.dynamic_sampling import GroupFilter, select_groups, trainable_groups
from trainer import settings
from trainer.overlong import mask_length_ended, overlong_penalty
from trainer.settings import overlong_buffer

PROMPT, RESPONSE = 3, 8


def rollout_of(trajectories: list[dict]) -> RolloutBatch:
    """A padded batch as the workers build it: each trajectory ``{uid, segments: [response length, ...], score,
    end_reason, failed, extra}``, one row per segment, the score on its last row's last response token."""
    rows = [
        (trajectory, index, length)
        for trajectory in trajectories
        for index, length in enumerate(trajectory["segments"])
    ]
    attention = torch.zeros(len(rows), PROMPT + RESPONSE, dtype=torch.long)
    scores = torch.zeros(len(rows), RESPONSE)
    for row, (trajectory, index, length) in enumerate(rows):
        attention[row, : PROMPT + length] = 1
        if index == len(trajectory["segments"]) - 1 and length:
            scores[row, length - 1] = trajectory.get("score", 0.0)
    batch = TensorDict(
        {
            "prompts": torch.ones(len(rows), PROMPT, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": attention[:, PROMPT:].clone(),
            "rm_scores": scores,
            "segment_index": torch.tensor([index for _, index, _ in rows]),
        },
        batch_size=[len(rows)],
    )
    fields = {
        "uid": [trajectory["uid"] for trajectory, _, _ in rows],
        "end_reason": [trajectory.get("end_reason", "stop") for trajectory, _, _ in rows],
        "failure": ["it raised" if trajectory.get("failed") else None for trajectory, _, _ in rows],
        "reward_extra_info": [trajectory.get("extra", {}) for trajectory, _, _ in rows],
    }
    return RolloutBatch(batch, {key: object_array(values) for key, values in fields.items()})


def test_overlong_penalty_is_dapos_soft_punishment():
    # L_max = 8, L_buf = 4, factor 0.5: nothing up to 4 tokens, then (4 - |y|) / 4 x 0.5 down to -0.5 at 8
    lengths = torch.tensor([0, 3, 4, 5, 7, 8])
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == [0, 0, 0, -0.125, -0.375, -0.5]
    assert overlong_penalty(lengths, 8, 8, 1.0).tolist() == [0, -0.375, -0.5, -0.625, -0.875, -1.0]


def test_overlong_buffer_shapes_each_trajectorys_last_segment_score():
    config = compose_config(
        [
            f"data.max_response_length={RESPONSE}",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "reward_model.overlong_buffer.log=true",
        ]
    )
    buffer = overlong_buffer(config)
    rollout = rollout_of(
        [
            {"uid": "a", "segments": [3], "score": 1.0},
            {"uid": "a", "segments": [6], "score": 1.0},
            # two segments: the last one's 7 response tokens count, not the first one's 8 or the sum
            {"uid": "b", "segments": [8, 7], "score": 0.0, "end_reason": "length"},
            {"uid": "b", "segments": [0], "failed": True},
        ]
    )
    metrics = buffer.shape(rollout)
    scores = rollout.batch["rm_scores"]
    assert scores.sum(-1).tolist() == [1.0, 0.75, 0.0, -0.375, 0.0]
    assert scores[1, 5] == 0.75 and scores[3, 6] == -0.375, "on the last response token, where the score is"
    assert metrics == {
        "overlong/reward/min": -0.375,
        "overlong/reward/mean": pytest.approx(-0.625 / 4),
        "overlong/reward/max": 0.0,
        "overlong/penalized_share": 0.5,
    }
    for setting, message in (
        ("len=0", r"len=0: must be in \(0"),
        ("len=9", r"len=9: must be in \(0, data.max_response_length=8\]"),
    ):
        with pytest.raises(ValueError, match=message):
            check_config(
                compose_config(
                    [
                        f"data.max_response_length={RESPONSE}",
                        "data.train_files=[x]",
                        "reward_model.overlong_buffer.enable=true",
                        f"reward_model.overlong_buffer.{setting}",
                    ]
                )
            )


def test_overlong_filtering_masks_every_row_of_a_length_ended_trajectory():
    rollout = rollout_of(
        [
            {"uid": "a", "segments": [4, 5], "end_reason": "length"},
            {"uid": "a", "segments": [5], "end_reason": "stop"},
            {"uid": "b", "segments": [8], "end_reason": "length"},
            {"uid": "b", "segments": [2], "end_reason": "context_length"},
        ]
    )
    batch = rollout.batch.clone()
    assert mask_length_ended(rollout, batch) == {"overlong/filtered_trajectories": 2.0}
    assert batch["response_mask"].sum(-1).tolist() == [0, 0, 5, 0, 2]
    assert rollout.batch["response_mask"].sum(-1).tolist() == [4, 5, 5, 8, 2], "the rollout's own mask is untouched"


def group_filter(metric: str, *overrides: str) -> GroupFilter:
    return settings.group_filter(
        compose_config(
            [
                "algorithm.filter_groups.enable=true",
                f"algorithm.filter_groups.metric={metric}",
                f"data.max_response_length={RESPONSE}",
                *overrides,
            ]
        )
    )


def test_groups_whose_metric_does_not_vary_are_dropped():
    rollout = rollout_of(
        [
            {"uid": "same", "segments": [2], "score": 1.0, "extra": {"acc": 1.0}},
            {"uid": "same", "segments": [3, 4], "score": 1.0, "extra": {"acc": 1.0}},  # two segments: one trajectory
            {"uid": "varies", "segments": [2], "score": 0.0, "extra": {"acc": 0.0}},
            {"uid": "varies", "segments": [2], "score": 1.0, "extra": {"acc": 1.0}},
            # a failed sample leaves its group: the one left has nothing to compare with
            {"uid": "one_left", "segments": [2], "score": 1.0, "extra": {"acc": 1.0}},
            {"uid": "one_left", "segments": [0], "failed": True},
            {"uid": "alone", "segments": [2], "score": 0.5, "extra": {"acc": 0.0}},
        ]
    )
    for metric in ("score", "acc", "seq_reward"):
        filter_ = group_filter(metric)
        assert filter_.informative(rollout) == {"same": False, "varies": True, "one_left": False, "alone": True}, metric
    kept, dropped = group_filter("acc").keep(rollout)
    assert dropped == 2 and list(kept.non_tensor_batch["uid"]) == ["varies", "varies", "alone"]
    assert kept.batch["rm_scores"].sum(-1).tolist() == [0.0, 1.0, 0.5]
    assert group_filter("acc").keep(select_groups(rollout, ["same"])) == (None, 1)
    # verl's seq_reward is the score with the overlong penalty: equal scores of unequal lengths then differ
    lengths = rollout_of([{"uid": "g", "segments": [2], "score": 1.0}, {"uid": "g", "segments": [8], "score": 1.0}])
    buffer = ("reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4")
    assert group_filter("score", *buffer).informative(lengths) == {"g": False}
    assert group_filter("seq_reward", *buffer).informative(lengths) == {"g": True}
    missing = r"metric='pred': trajectory 0 of the batch has no 'pred' in its reward_extra_info \(it has \['acc'\]\)"
    with pytest.raises(ValueError, match=missing):
        group_filter("pred").informative(rollout)
    assert settings.group_filter(compose_config([])) is None


def test_a_short_batch_keeps_as_many_groups_as_split_over_the_ranks():
    rollout = rollout_of([{"uid": uid, "segments": [2]} for uid in "abc" for _ in range(3)])  # 3 groups of 3
    assert trainable_groups(rollout, 4, ranks=1) == (rollout, 0)
    kept, left_out = trainable_groups(rollout, 4, ranks=2)  # 3 x 3 trajectories do not split over 2 ranks; 2 x 3 do
    assert left_out == 1 and list(dict.fromkeys(kept.non_tensor_batch["uid"])) == ["a", "b"]
    assert trainable_groups(rollout, 2, ranks=3)[1] == 1
    assert trainable_groups(select_groups(rollout, ["a"]), 4, ranks=2) == (None, 1)


def test_a_generation_batch_of_another_size_needs_dynamic_sampling():
    base = ["data.train_files=[x]", "data.train_batch_size=4"]
    with pytest.raises(
        ValueError,
        match=r"gen_batch_size=8 differs from data.train_batch_size=4: .*\(algorithm.filter_groups.enable=true\)",
    ):
        check_config(compose_config([*base, "data.gen_batch_size=8"]))
    with pytest.raises(ValueError, match="data.gen_batch_size=0 must be positive"):
        check_config(compose_config([*base, "data.gen_batch_size=0", "algorithm.filter_groups.enable=true"]))
    check_config(compose_config([*base, "data.gen_batch_size=8", "algorithm.filter_groups.enable=true"]))
    check_config(compose_config([*base, "data.gen_batch_size=4"]))


# ---------------------------------------------------------------------------------------------- real runs


def coin_config(coin_model: str, tmp_path, *overrides: str, sources: tuple[str, ...] = ()) -> object:
    """The coin task (reward 1 for "yes"), 4 prompts x 2 samples a step on one CPU rank; row i's data source is
    ``sources[i]`` where given (a source without a reward function scores 0), else ``coin``."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "agent_name": "single_turn_agent",
            "data_source": sources[i] if i < len(sources) else "coin",
            "extra_info": {"index": i},
        }
        for i in range(40)
    ]
    train = write_rows(rows, str(tmp_path / "train.jsonl"))
    return small_config(
        f"actor_rollout_ref.model.path={coin_model}",
        f"data.train_files=[{train}]",
        "data.train_batch_size=4",
        "data.shuffle=false",
        "data.max_response_length=4",
        "actor_rollout_ref.rollout.n=2",
        "+custom_reward_function.by_data_source.coin=tests.support.models.says_yes",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"trainer.rollout_data_dir={tmp_path / 'run' / 'rollouts'}",
        "algorithm.filter_groups.enable=true",
        *overrides,
    )


def trained_groups(tmp_path, step: int) -> dict[str, list[dict]]:
    """The trajectories a step trained (its rollout dump), by GRPO group."""
    groups = defaultdict(list)
    for record in read_rollout_dump(tmp_path / "run" / "rollouts" / f"step_{step:06d}.parquet")[1]:
        groups[record["uid"]].append(record)
    return groups


def acc(record: dict) -> float:
    return record["reward_parts"]["reward_extra_info"]["acc"]


def test_synchronous_dynamic_sampling_trains_only_groups_with_a_signal(local_ray, coin_model, tmp_path):
    history = fit(
        coin_config(
            coin_model,
            tmp_path,
            "algorithm.filter_groups.metric=acc",
            "data.gen_batch_size=6",
            "trainer.total_training_steps=3",
            "trainer.save_freq=3",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "reward_model.overlong_buffer.log=true",
        )
    )
    assert [line["step"] for line in history] == [1, 2, 3]
    for line in history:
        groups = trained_groups(tmp_path, line["step"])
        assert len(groups) == line["dynamic_sampling/kept_groups"] == 4 and all(
            len(group) == 2 for group in groups.values()
        )
        assert all(len({acc(record) for record in group}) == 2 for group in groups.values()), (
            "a group whose samples all scored alike"
        )
        # every generation batch's 6 groups were trained, dropped, or left over past the batch's 4
        made = line["dynamic_sampling/generation_batches"]
        outcomes = ("kept_groups", "dropped_groups", "surplus_groups")
        assert 6 * made == sum(line[f"dynamic_sampling/{outcome}"] for outcome in outcomes)
        # L_max = L_buf = 4: every response is penalised by |y| / 4 x 0.5, and trains on that score
        records = [record for group in groups.values() for record in group]
        penalties = [-record["response_length"] / 4 * 0.5 for record in records]
        for record, penalty in zip(records, penalties):
            assert record["score"] == pytest.approx(record["reward_parts"]["reward_score"] + penalty)
        assert (
            line["overlong/reward/mean"] == pytest.approx(np.mean(penalties))
            and line["overlong/penalized_share"] == 1.0
        )
        assert line["critic/score/mean"] == pytest.approx(np.mean([record["score"] for record in records]))
    dropped = sum(line["dynamic_sampling/dropped_groups"] for line in history)
    print("groups dropped per step:", [line["dynamic_sampling/dropped_groups"] for line in history])
    assert dropped > 0, "two samples of a coin agree half the time: some group must have been dropped"
    # the data position counts every generation batch: a resume goes on after the rows they drew
    made = sum(line["dynamic_sampling/generation_batches"] for line in history)
    state = json.loads((tmp_path / "run" / "global_step_3" / "trainer_state.json").read_text())
    assert state["sampler_position"] == made and state["untrained_rows"] == []
    drawn = {
        record["index"]
        for line in history
        for group in trained_groups(tmp_path, line["step"]).values()
        for record in group
    }
    assert {int(index) for index in drawn} <= set(range(6 * made))


def test_a_step_left_without_groups_skips_its_update_and_overlong_filtering_masks_length_ended_samples(
    local_ray, coin_model, tmp_path
):
    # step 1's rows score 0 whatever they say: no group varies, and after max_num_gen_batches=1 nothing is left to
    # train. Step 2's rows are the coin's, answered in one token (max_response_length=1): every sample ends by length
    config = coin_config(
        coin_model,
        tmp_path,
        "algorithm.filter_groups.max_num_gen_batches=1",
        "actor_rollout_ref.rollout.n=4",
        "data.max_response_length=1",
        "algorithm.overlong_filtering=true",
        "actor_rollout_ref.actor.optim.lr=2e-3",
        "trainer.total_training_steps=2",
        sources=("unscored",) * 4,
    )
    with pytest.warns(UserWarning) as caught:
        skipped, trained = fit(config)
    messages = [str(warning.message) for warning in caught]
    assert any(
        "step 1: dynamic sampling (algorithm.filter_groups) left no group to train" in message for message in messages
    ), messages
    assert skipped["dynamic_sampling/kept_groups"] == 0 and skipped["dynamic_sampling/dropped_groups"] == 4
    assert skipped["dynamic_sampling/generation_batches"] == 1 and not any(key.startswith("actor/") for key in skipped)
    assert not (tmp_path / "run" / "rollouts" / "step_000001.parquet").exists()
    # step 2 trained (its samples stamped with version 1: the skipped step pushed the unchanged policy as version 1)
    kept = trained["dynamic_sampling/kept_groups"]
    assert kept >= 1 and trained["dynamic_sampling/dropped_groups"] == 4 - kept
    records = [record for group in trained_groups(tmp_path, 2).values() for record in group]
    assert {record["policy_version"] for record in records} == {1} and trained["async/staleness/max"] == 0
    assert all(record["finish_reason"] == "length" for record in records)
    if kept < 4:
        limit = f"step 2: after 1 generation batches (algorithm.filter_groups.max_num_gen_batches=1), {kept} of the 4"
        assert any(limit in message for message in messages), messages
    # every sample ended by length: all masked out of the loss, which then moves nothing
    assert trained["overlong/filtered_trajectories"] == 4 * kept
    assert trained["actor/grad_norm"] == 0 and trained["actor/pg_loss"] == 0


def test_asynchronous_dynamic_sampling_keeps_the_staleness_bound(local_ray, coin_model, tmp_path):
    history = fit(
        coin_config(
            coin_model,
            tmp_path,
            "algorithm.filter_groups.metric=acc",
            "trainer.total_training_steps=4",
            "actor_rollout_ref.actor.optim.lr=2e-3",
            "async_training.max_staleness=1",
            "async_training.partial_rollout=true",
            "actor_rollout_ref.rollout.free_cache_engine=false",
        )
    )
    assert [line["step"] for line in history] == [1, 2, 3, 4]
    for line in history:
        step, groups = line["step"], trained_groups(tmp_path, line["step"])
        assert len(groups) == line["dynamic_sampling/kept_groups"] == 4 and all(
            len(group) == 2 for group in groups.values()
        )
        assert all(len({acc(record) for record in group}) == 2 for group in groups.values()), (
            "a group whose samples all scored alike"
        )
        # step s trains version s - 1 on groups started at version s - 2 or later
        assert all(record["policy_version"] >= step - 2 for group in groups.values() for record in group)
        assert line["async/staleness/max"] <= 1
        assert line["dynamic_sampling/finished_groups"] >= line["dynamic_sampling/dropped_groups"]
    print("groups dropped per step:", [line["dynamic_sampling/dropped_groups"] for line in history])
    assert sum(line["dynamic_sampling/dropped_groups"] for line in history) > 0
