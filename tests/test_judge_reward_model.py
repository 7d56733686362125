"""A discriminative reward model (reward_model.kind=discriminative, verl's DisRM) on real Ray: with no reward
function set, each sample's reward is the model's score of its conversation built as verl builds it (a multi-turn
response's special tokens kept), as a plain forward of the checkpoint gives it."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.context import ContextStrategy, sliding_window
from agentloop.agent_loop.trajectory import Trajectory
from agentloop.judge import Judge, judge_session
from agentloop.protocol import AgentLoopOutput, TokenOutput
from agentloop.rewards import score_output
from tests.support.config import small_config


@pytest.fixture(scope="module")
def manager(local_ray, ok_model, reward_model_path):
    manager = AgentLoopManager(
        small_config(
            f"actor_rollout_ref.model.path={ok_model}",
            "reward_model.enable=true",
            "reward_model.kind=discriminative",
            f"reward_model.model.path={reward_model_path}",
            "actor_rollout_ref.rollout.env.class_name=tests.support.probe_envs.DoneAtTurn2Env",
            "data.max_response_length=64",
        )
    )
    yield manager
    manager.shutdown()


def verl_reward_model_input(policy_tokenizer, tokenizer, raw_prompt, response_ids) -> list[int]:
    """The ids verl's DisRM scores (``fsdp_workers._switch_chat_template``; its reward loop builds the same text): the
    valid response decoded with its special tokens, the eos text removed, as the assistant's message after the row's
    prompt, rendered by the reward model's template and tokenized without special tokens added."""
    response = policy_tokenizer.decode(response_ids).replace(policy_tokenizer.eos_token, "")
    conversation = [*raw_prompt, {"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_reward_is_the_reward_models_score_of_the_conversation_as_verl_builds_it(manager, reward_model_path):
    rows = [{"prompt": [{"role": "user", "content": f"hello {i}"}], "extra_info": {"index": i}} for i in range(3)]
    # and two turns with an observation between them
    rows += [{"prompt": [{"role": "user", "content": f"walk {i}"}], "agent_name": "env_agent"} for i in range(2)]
    batch = manager.generate_sequences(rows)
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path, dtype=torch.float32).eval()
    policy_tokenizer = AutoTokenizer.from_pretrained(manager.config.actor_rollout_ref.model.path)

    def score(ids: list[int]) -> float:
        with torch.no_grad():
            return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    fields, responses = batch.non_tensor_batch, batch.batch["responses"]
    scores = []
    for i, row in enumerate(rows):
        length = int(batch.batch["attention_mask"][i, -responses.shape[1] :].sum())  # verl's valid response length
        ids = verl_reward_model_input(policy_tokenizer, tokenizer, row["prompt"], responses[i, :length])
        expected = score(ids)
        assert fields["reward_source"][i] == "reward_model" and fields["failure"][i] is None
        assert fields["reward_score"][i] == pytest.approx(expected, abs=1e-5)
        (call,) = fields["judge_calls"][i]
        assert call.prompt_tokens == len(ids) and call.error is None
        scores.append(expected)
        if row.get("agent_name") == "env_agent":  # an observation's special tokens are part of what is scored
            assert fields["num_turns"][i] == 4 and "<|im_start|>user" in tokenizer.decode(ids)
            skipped = policy_tokenizer.decode(responses[i, :length], skip_special_tokens=True)
            conversation = [*row["prompt"], {"role": "assistant", "content": skipped}]
            skipped_ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
            assert score(skipped_ids) != pytest.approx(expected, abs=1e-5)
    assert len(set(scores)) == len(rows)  # the conversations differ, and so do their scores
    assert batch.meta_info["judge/calls"] == len(rows)


def test_a_rewritten_trajectory_is_scored_on_its_whole_response(manager, reward_model_path):
    """A trajectory whose context a sliding window rewrote is scored on every turn and observation: verl's input for
    the same conversation appended, not its last segment's."""
    policy_tokenizer = AutoTokenizer.from_pretrained(manager.config.actor_rollout_ref.model.path)
    prompt = [{"role": "user", "content": "walk"}]

    def rolled_out(context: ContextStrategy) -> AgentLoopOutput:
        ids = policy_tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
        trajectory = Trajectory(policy_tokenizer, prompt, list(ids), None, context=context)
        for turn in range(3):
            reply = policy_tokenizer.encode(f"step {turn}", add_special_tokens=False) + [policy_tokenizer.eos_token_id]
            trajectory.add_model_turn(TokenOutput(reply, [-0.5] * len(reply), "stop"))
            observation = {"role": "user", "content": f"observation {turn}"}
            if turn < 2:
                assert trajectory.add_observation_within([observation], 64) is not None
        return trajectory.to_output()

    window = rolled_out(ContextStrategy("sliding_window", functools.partial(sliding_window, window_turns=1)))
    appended = rolled_out(ContextStrategy("append"))
    assert len(window.all_segments()) == 2
    judge = Judge.from_settings(manager.judge_settings, manager.judges.servers)
    with judge_session(judge, "rewritten"):
        score = asyncio.run(score_output(manager.settings.rewards, policy_tokenizer, {"prompt": prompt}, window, judge))
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = verl_reward_model_input(policy_tokenizer, tokenizer, prompt, appended.response_ids)
        expected = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    assert score.reward_source == "reward_model" and window.reward_score == pytest.approx(expected, abs=1e-5)


def test_a_verl_job_with_a_reward_model_trains_on_its_scores(reward_model_path, model_path, tmp_path):
    """verl's keys (reward_model.enable, reward_model.model.path) take effect: the job's samples are scored by the
    reward model (its kind read from the checkpoint), not by the data source's rule, and no key is warned away."""
    from tests.support.verl_job import data as verl_data
    from tests.test_verl_dropin import JOB, dumped_samples, run_verl_job

    train = verl_data.write_split(str(tmp_path / "gsm8k"), "tool", "train", 4)
    result = run_verl_job(
        tmp_path,
        "gsm8k_multiturn_grpo",
        f"actor_rollout_ref.model.path={model_path}",
        f"data.train_files={train}",
        f"data.val_files={train}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={JOB / 'config/tool_config/gsm8k_tool_config.yaml'}",
        "reward_model.enable=True",
        f"reward_model.model.path={reward_model_path}",
    )
    assert "reward_model.enable" not in result.stdout + result.stderr
    samples = dumped_samples(tmp_path)
    assert samples and all(record["reward_parts"]["reward_source"] == "reward_model" for record in samples)
    assert all(len(record["extra"]["judge_calls"]) == 1 for record in samples)
