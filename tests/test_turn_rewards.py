"""Per-turn rewards on a real rollout: tool_agent through the manager with the scripted test model ("script multi":
calculator, then submit_answer, then a closing reply), its calculator giving a step reward. The batch's
``turn_rewards`` sit on the right tokens, the score's remainder on the last, and the turn-level advantages follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from agentloop import AgentLoopManager
from agentloop.agent_loop.trajectory import state_digest
from agentloop.dumps import mask_runs, read_rollout_dump
from agentloop.rows import write_rows
from tests.support.config import small_config
from tests.support.models import script_row
from trainer import algorithms
from trainer.main_ppo import run

STEP_REWARD = 0.25
PROMPT_LENGTH = 768


@pytest.fixture(scope="module")
def stepped_tools(scripted_model, tmp_path_factory) -> Path:
    """The scripted model's tools with the calculator swapped for one that gives a step reward (same name and schema,
    rendered in the same order: the prompt the model was taught is unchanged)."""
    tools = yaml.safe_load(Path(scripted_model.tools_path).read_text())
    for tool in tools["tools"]:
        if tool["tool_schema"]["function"]["name"] == "calculator":
            tool["class_name"] = "tests.support.probe_tools.SteppedCalculatorTool"
            tool["config"]["step_reward"] = STEP_REWARD
    path = tmp_path_factory.mktemp("stepped_tools") / "tools.yaml"
    path.write_text(yaml.safe_dump(tools, sort_keys=False))
    return path


def stepped_config(scripted_model, stepped_tools: Path, *overrides: str):
    return small_config(
        f"actor_rollout_ref.model.path={scripted_model.path}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={stepped_tools}",
        f"data.max_prompt_length={PROMPT_LENGTH}",
        "data.max_response_length=256",
        *overrides,
    )


@pytest.fixture(scope="module")
def batch(local_ray, scripted_model, stepped_tools):
    """One greedy rollout of "script multi"."""
    manager = AgentLoopManager(stepped_config(scripted_model, stepped_tools))
    try:
        return manager.generate_sequences([script_row("multi")], validate=True)
    finally:
        manager.shutdown()


def test_turn_rewards_sit_on_each_turns_last_model_token_and_sum_with_the_remainder_to_the_score(batch):
    turns = batch.non_tensor_batch["turns"][0]
    assert [turn.step_reward for turn in turns] == [STEP_REWARD, 0.0, 0.0]
    length = int(batch.batch["attention_mask"][0, PROMPT_LENGTH:].sum())
    mask = batch.batch["response_mask"][0, :length].tolist()
    runs = mask_runs(mask)
    assert [value for value, _, _ in runs] == [1, 0, 1, 0, 1]
    model_runs = [(start, end) for value, start, end in runs if value]
    assert [end - start for start, end in model_runs] == [turn.model_tokens for turn in turns]

    # each token's turn: a model turn's own, an observation's the turn it answers; -1 on padding
    expected_index = [
        turn
        for turn, (start, _) in enumerate(model_runs)
        for _ in range(start, model_runs[turn + 1][0] if turn < 2 else length)
    ]
    assert batch.batch["turn_index"][0].tolist() == expected_index + [-1] * (batch.batch["responses"].shape[1] - length)
    # the calculator's turn has its step reward on its last model token, and nothing else has one
    turn_rewards = batch.batch["turn_rewards"][0]
    first_end = model_runs[0][1] - 1
    assert turn_rewards[first_end] == STEP_REWARD and turn_rewards.sum() == STEP_REWARD

    # the score (submit_answer's reward) on the last token; distributed, the last turn keeps the rest of it
    score = batch.non_tensor_batch["reward_score"][0]
    assert score == 1.0 and batch.batch["rm_scores"][0, length - 1] == score
    mask_tensor = batch.batch["response_mask"].float()
    rewards = algorithms.turn_token_rewards(
        batch.batch["rm_scores"], batch.batch["turn_rewards"], mask_tensor, batch.batch["segment_index"]
    )
    expected = torch.zeros_like(rewards)
    expected[0, first_end], expected[0, length - 1] = STEP_REWARD, score - STEP_REWARD
    assert torch.equal(rewards, expected) and rewards.sum() == score

    # the turns answered the prompt, the calculator's result and the answer checker's: three states
    assert [turn.state_key for turn in turns] == [
        state_digest(script_row("multi")["prompt"]),
        state_digest([{"role": "tool", "content": "5"}]),
        state_digest([{"role": "tool", "content": "correct"}]),
    ]

    # turn-level GRPO (a group of one: mean 0, std 1) puts each turn's return on its model tokens: 1.0, 0.75, 0.75
    advantages, _ = algorithms.turn_grpo_advantage(
        rewards, batch.batch["turn_index"], mask_tensor, ["only"], segment_index=batch.batch["segment_index"]
    )
    for (start, end), turn_return in zip(model_runs, [score, score - STEP_REWARD, score - STEP_REWARD]):
        assert torch.allclose(advantages[0, start:end], torch.tensor(turn_return / (1 + 1e-6)))
    assert torch.all(advantages[0][torch.tensor(mask + [0] * (advantages.shape[1] - length)) == 0] == 0)


def test_a_gigpo_training_step_gives_each_turn_one_advantage(local_ray, scripted_model, stepped_tools, tmp_path):
    """The trainer's wiring (``_advantages``: the turn rewards, the GRPO groups and the turns' states) on real rollouts:
    each model turn's tokens share one advantage, and the dump lists the turns' rewards."""
    rows = [{**script_row("multi"), "extra_info": {**script_row("multi")["extra_info"], "index": i}} for i in range(2)]
    train = write_rows(rows, str(tmp_path / "train.jsonl"))
    history = run(
        stepped_config(
            scripted_model,
            stepped_tools,
            f"data.train_files=[{train}]",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.temperature=0.3",  # sampled, but the scripted turns are far from their margins
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "algorithm.adv_estimator=gigpo",
            "algorithm.gamma=0.9",
            "trainer.total_training_steps=1",
            "trainer.logger=[console]",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            f"trainer.default_local_dir={tmp_path}",
        )
    )
    assert [line["step"] for line in history] == [1]
    _, records = read_rollout_dump(tmp_path / "rollouts" / "step_000001.parquet")
    assert len(records) == 4
    for record in records:
        assert record["turn_rewards"] == [STEP_REWARD, 0.0, 0.0]
        for turn in record["turns"]:
            span = record["advantages"][turn["start"] : turn["end"]]
            assert len(set(span)) == 1 and (turn["role"] == "assistant" or span == [0.0] * len(span))
