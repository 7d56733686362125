"""The padded layout (agentloop/postprocess.py's docstring), checked cell by cell on a batch with mixed lengths."""

import pytest
import torch

from agentloop.postprocess import check_reward_has_a_token, pad_outputs
from agentloop.protocol import AgentLoopOutput, Segment, TurnRecord

PAD = 0


def test_padding_layout_cell_by_cell():
    outputs = [
        # multi-turn: model tokens 11 12, observation 13 14, model token 15
        AgentLoopOutput(
            [1, 2, 3], [11, 12, 13, 14, 15], [1, 1, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, -0.5], reward_score=1.0
        ),
        AgentLoopOutput([4], [21], [1], [-0.7]),
        AgentLoopOutput([5, 6, 7, 8], [31, 32, 33], [1, 1, 1], [-1.0, -2.0, -3.0], reward_score=0.5),
    ]
    batch = pad_outputs(outputs, prompt_length=4, response_length=6, pad_token_id=PAD)
    assert batch.batch_size == torch.Size([3])
    assert batch["prompts"].tolist() == [[0, 1, 2, 3], [0, 0, 0, 4], [5, 6, 7, 8]]
    assert batch["responses"].tolist() == [[11, 12, 13, 14, 15, 0], [21, 0, 0, 0, 0, 0], [31, 32, 33, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert batch["input_ids"].tolist() == [
        [0, 1, 2, 3, 11, 12, 13, 14, 15, 0],
        [0, 0, 0, 4, 21, 0, 0, 0, 0, 0],
        [5, 6, 7, 8, 31, 32, 33, 0, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [
        [0, 1, 1, 1, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    ]
    assert batch["position_ids"].tolist() == [
        [0, 0, 1, 2, 3, 4, 5, 6, 7, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 0],
        [0, 1, 2, 3, 4, 5, 6, 0, 0, 0],
    ]
    expected_logprobs = [[-0.1, -0.2, 0, 0, -0.5, 0], [-0.7, 0, 0, 0, 0, 0], [-1, -2, -3, 0, 0, 0]]
    assert torch.allclose(batch["rollout_log_probs"], torch.tensor(expected_logprobs))
    # the score sits on the last response token; rows without one score 0
    assert batch["rm_scores"].tolist() == [[0, 0, 0, 0, 1.0, 0], [0] * 6, [0, 0, 0.5, 0, 0, 0]]
    # without turn records a trajectory is one turn, and no turn reported a reward
    assert batch["turn_index"].tolist() == [[0, 0, 0, 0, 0, -1], [0, -1, -1, -1, -1, -1], [0, 0, 0, -1, -1, -1]]
    assert batch["turn_rewards"].tolist() == [[0] * 6] * 3


def two_segment_trajectory() -> AgentLoopOutput:
    """Segment 1: turn 0 (2 tokens), an observation (2), turn 1 (1); segment 2: turn 2 (2 tokens), an observation,
    turn 3 (1); then turn 4, aborted before its first token. Each turn reports what its tools, interaction or env said."""
    first = Segment([1, 2], [11, 12, 13, 14, 15], [1, 1, 0, 0, 1], [0.0] * 5)
    turns = [
        TurnRecord(2, 2, step_reward=0.5),
        TurnRecord(1, interaction_score=0.25),
        TurnRecord(2, 1, env_reward=1.0),
        TurnRecord(1, step_reward=0.375, interaction_score=0.0),
        TurnRecord(0, step_reward=0.125),
    ]
    return AgentLoopOutput(
        [3], [21, 22, 23, 24], [1, 1, 0, 1], [0.0] * 4, reward_score=2.0, segments=[first], turns=turns
    )


def test_turn_rewards_sit_on_each_turns_last_model_token():
    batch = pad_outputs(
        [two_segment_trajectory(), AgentLoopOutput([1], [5, 6], [1, 1], [0.0, 0.0], reward_score=1.0)], 4, 6, PAD
    )
    assert batch["segment_index"].tolist() == [0, 1, 0]
    # an observation belongs to the turn it answers; a turn's index runs on through the segments
    assert batch["turn_index"].tolist() == [[0, 0, 0, 0, 1, -1], [2, 2, 2, 3, -1, -1], [0, 0, -1, -1, -1, -1]]
    # the aborted turn 4 has no token: its reward goes to the model token before it, turn 3's
    assert batch["turn_rewards"].tolist() == [[0, 0.5, 0, 0, 0.25, 0], [0, 1.0, 0, 0.5, 0, 0], [0] * 6]
    assert batch["rm_scores"].tolist() == [[0] * 6, [0, 0, 0, 2.0, 0, 0], [0, 1.0, 0, 0, 0, 0]]


def test_turn_rewards_of_cut_turns_and_of_turns_that_do_not_describe_the_tokens():
    # cut at 3 response tokens: turn 1's token and turn 3's are gone, their rewards go to the model token before them
    batch = pad_outputs([two_segment_trajectory()], 4, 3, PAD)
    assert batch["turn_index"].tolist() == [[0, 0, 0], [2, 2, 2]]
    assert batch["turn_rewards"].tolist() == [[0, 0.75, 0], [0, 1.5, 0]]
    # turns whose tokens do not add up to the response's: one turn, every reward on the last model token
    wrong = AgentLoopOutput(
        [1],
        [5, 6, 7, 8],
        [1, 0, 1, 1],
        [0.0] * 4,
        turns=[TurnRecord(1, step_reward=0.5), TurnRecord(1, env_reward=0.25)],
    )
    batch = pad_outputs([wrong], 2, 5, PAD)
    assert batch["turn_index"].tolist() == [[0, 0, 0, 0, -1]] and batch["turn_rewards"].tolist() == [[0, 0, 0, 0.75, 0]]


def test_parts_with_and_without_rewards_concatenate():
    # two workers: one scored its trajectories, the other had none to score
    scored = pad_outputs([AgentLoopOutput([1], [2], [1], [-0.1], reward_score=1.0)], 2, 3, PAD)
    unscored = pad_outputs([AgentLoopOutput([1], [2], [1], [-0.1])], 2, 3, PAD)
    assert torch.cat([scored, unscored])["rm_scores"].tolist() == [[1.0, 0, 0], [0, 0, 0]]


def test_a_reward_with_no_response_token_to_sit_on_is_an_error_never_dropped():
    # a trajectory whose last segment is empty (a rewrite that never got its reply): its reward has nowhere to go
    answered = Segment([1], [5, 6], [1, 1], [0.0, 0.0])
    empty_last = AgentLoopOutput([1, 2], [], [], [], reward_score=1.0, segments=[answered])
    with pytest.raises(ValueError, match=r"reward 1.0 has no response token to sit on: its last segment \(of 2\) has"):
        pad_outputs([empty_last], 4, 6, PAD)
    with pytest.raises(ValueError, match="no response token to sit on"):
        check_reward_has_a_token(AgentLoopOutput([1], [], [], [], reward_score=-0.5))
    # a reward of 0 (or none) changes no sum: such rows pad as before, and every placed reward sums to its score
    unrewarded = AgentLoopOutput([1, 2], [], [], [], reward_score=0.0, segments=[answered])
    batch = pad_outputs([unrewarded, two_segment_trajectory()], 4, 6, PAD)
    assert batch["rm_scores"].sum().item() == 2.0 and batch["rm_scores"][:2].sum().item() == 0.0


def test_overlong_response_is_cut_and_overlong_prompt_rejected():
    long = AgentLoopOutput([1], [9] * 8, [1] * 8, [-1.0] * 8)
    batch = pad_outputs([long], prompt_length=2, response_length=5, pad_token_id=PAD)
    assert batch["responses"].tolist() == [[9] * 5] and batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="prompt has 3 tokens, more than prompt_length=2"):
        pad_outputs([AgentLoopOutput([1, 2, 3], [], [], [])], prompt_length=2, response_length=5, pad_token_id=PAD)


def test_output_lengths_must_agree():
    with pytest.raises(ValueError, match="same length"):
        AgentLoopOutput([1], [2, 3], [1], [0.0, 0.0])
