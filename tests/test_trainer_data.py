"""Training data: parquet and jsonl rows, fast failures naming file and row, filtering, resumable order."""

from __future__ import annotations

import itertools

import pytest

from agentloop.rows import write_rows
from agentloop.tasks.arithmetic.data import make_rows
from trainer.data import BatchSampler, load_dataset, read_rows


def test_parquet_and_jsonl_round_trip(tmp_path):
    rows = make_rows(10)
    assert read_rows(write_rows(rows, str(tmp_path / "a.parquet"))) == rows
    assert (
        load_dataset([write_rows(rows[:4], str(tmp_path / "b.jsonl")), str(tmp_path / "a.parquet")]) == rows[:4] + rows
    )


@pytest.mark.parametrize(
    "content, message",
    [
        ("", r"no rows"),
        ('{"prompt": []}\n', r"row 0: 'prompt' must be a non-empty list"),
        (
            '{"prompt": [{"role": "user", "content": "a"}]}\n{"prompt": [{"text": "b"}]}\n',
            r"row 1: prompt\[0\] must be a \{role, content\}",
        ),
        ('{"prompt": [{"role": "user", "content": "a"}]}\n{oops\n', r"line 2 is not valid JSON"),
        ("[1, 2]\n", r"row 0: expected a mapping"),
        (
            '{"prompt": [{"role": "user", "content": "a"}], "turns": 3}\n',
            r"row 0: field 'turns' is a column the rollout fills .* move it under extra_info",
        ),
    ],
)
def test_bad_data_names_file_and_row(tmp_path, content, message):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        read_rows(str(path))
    assert str(path) in str(error.value)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(str(tmp_path / "nope.parquet"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="use .parquet or .jsonl"):
        read_rows(str(tmp_path / "x.csv"))


def test_filter_overlong_prompts(tmp_path):
    rows = make_rows(12)
    path = write_rows(rows, str(tmp_path / "t.jsonl"))
    length = lambda row: len(row["prompt"][1]["content"])  # noqa: E731
    limit = min(map(length, rows))
    kept = load_dataset(path, prompt_length=length, max_prompt_length=limit, filter_overlong_prompts=True)
    assert kept == [row for row in rows if length(row) <= limit] and 0 < len(kept) < 12
    with pytest.raises(ValueError, match="every row .* longer than data.max_prompt_length=1"):
        load_dataset(path, prompt_length=length, max_prompt_length=1, filter_overlong_prompts=True)


def test_batch_sampler_is_seeded_and_resumes_in_the_same_order():
    sampler = BatchSampler(10, 3, seed=7)
    first = list(sampler.batches(7))  # crosses into the third epoch
    assert all(len(batch) == 3 for batch in first)
    assert sorted(sum(first[:3], [])) == sorted(set(sum(first[:3], [])))  # no repeats within an epoch
    assert first[:3] != first[3:6]  # a new shuffle each epoch
    assert list(sampler.batches(2)) == first[:2]  # reading does not move it
    resumed = BatchSampler(10, 3, seed=7)
    resumed.restore(sampler.state(handed_out=4))
    assert list(resumed.batches(3)) == first[4:7]
    assert BatchSampler(10, 3, seed=8)._order(0) != BatchSampler(10, 3, seed=7)._order(0)
    with pytest.raises(ValueError, match="train_batch_size=11 is larger than the dataset"):
        BatchSampler(10, 11)


def test_batch_sampler_replays_rows_handed_out_but_not_trained():
    """An async run's stream takes batches ahead: a checkpoint records the rows not trained yet, and a
    resume hands them out first, so every row is trained exactly once."""
    sampler = BatchSampler(12, 2, shuffle=False)
    # 3 batches handed out ([0, 1], [2, 3], [4, 5]); rows 3, 4 and 5 not trained yet (one row of batch 2 was)
    state = sampler.state(handed_out=3, untrained=[3, 4, 5, 2])
    assert state == {"sampler_position": 3, "untrained_rows": [3, 4, 5, 2]}
    resumed = BatchSampler(12, 2, shuffle=False)
    resumed.restore(state)
    assert list(resumed.batches(4)) == [[3, 4], [5, 2], [6, 7], [8, 9]]
    # saved again before the replayed rows all went out: those not handed out stay to replay
    assert resumed.state(handed_out=1, untrained=[4]) == {"sampler_position": 3, "untrained_rows": [4, 5, 2]}
    assert resumed.state(handed_out=3, untrained=[7]) == {"sampler_position": 4, "untrained_rows": [7]}
    with pytest.raises(ValueError, match="3 rows to train, not whole batches of data.train_batch_size=2"):
        resumed.restore({"sampler_position": 0, "untrained_rows": [1, 2, 3]})


def test_batch_sampler_replays_a_short_batch_for_readers_that_take_rows_as_they_come():
    """Dynamic sampling drops rows it generated: an async run's checkpoint may leave rows to replay that are not
    whole batches; the last replayed batch goes out short, then the order continues where it was."""
    sampler = BatchSampler(12, 4, shuffle=False, size_key="data.gen_batch_size")
    state = {"sampler_position": 2, "untrained_rows": [5, 6, 7, 0, 1]}
    with pytest.raises(ValueError, match="5 rows to train, not whole batches of data.gen_batch_size=4"):
        sampler.restore(state)
    sampler.restore(state, partial_replay=True)
    assert list(sampler.batches(3)) == [[5, 6, 7, 0], [1], [8, 9, 10, 11]]
    assert list(itertools.islice(sampler.batches(None), 5))[3:] == [[0, 1, 2, 3], [4, 5, 6, 7]], (
        "None: epoch after epoch"
    )
    # saved after the short batch went out: nothing left to replay, the order goes on after batch 2
    assert sampler.state(handed_out=2, untrained=[1]) == {"sampler_position": 2, "untrained_rows": [1]}
    assert sampler.state(handed_out=3) == {"sampler_position": 3, "untrained_rows": []}
    assert sampler.state(handed_out=1) == {"sampler_position": 2, "untrained_rows": [1]}


def test_main_job_config_builds_its_data_on_first_use(tmp_path, monkeypatch):
    from agentloop.config import compose_config
    from agentloop.preparation import prepare

    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path))
    config = compose_config(config_name="arithmetic_grpo")
    prepare(config, only=["train_data", "val_data"])
    train, val = read_rows(config.data.train_files[0]), read_rows(config.data.val_files[0])
    assert (len(train), len(val)) == (512, 64)
    assert train == make_rows(512, split="train", max_operand=9) and val == make_rows(64, split="test", max_operand=9)
    assert all(row["agent_name"] == "tool_agent" for row in train)
    assert config.actor_rollout_ref.rollout.multi_turn.tool_config_path.endswith("config/tools/arithmetic.yaml")
    assert compose_config(config_name="arithmetic_grpo").data.train_files[0] == config.data.train_files[0]
