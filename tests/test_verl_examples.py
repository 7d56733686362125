"""verl's own example classes under the renamed package: ``agentloop.tools.gsm8k_tool.Gsm8kTool``,
``agentloop.interactions.gsm8k_interaction.Gsm8kInteraction`` and ``agentloop.utils.rollout_trace.rollout_trace_op``.

Each class is held to verl's behaviour (the expected values are worked out by hand from verl's rules, not by calling
the scorer), then verl's ``examples/sglang_multiturn`` configs, with only ``verl.`` renamed, are composed and rolled
out on the tiny model taught to play the example (``tests.support.models.build_gsm8k_model``): the tool and the
interaction come from the renamed names in verl's YAMLs and answer the model."""

from __future__ import annotations

import asyncio
import inspect
import warnings

import pytest
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.config import compose_config
from agentloop.interactions import load_interactions
from agentloop.interactions.gsm8k_interaction import Gsm8kInteraction
from agentloop.tools.gsm8k_tool import Gsm8kTool
from agentloop.tools.schemas import ToolResponse
from agentloop.tools.toolset import load_tool_set
from agentloop.utils.rollout_trace import rollout_trace_op
from tests.support.models import (
    GSM8K_INTERACTIONS_PATH,
    GSM8K_TOOLS_PATH,
    VERL_JOB_CONFIG,
    gsm8k_example_rows,
    gsm8k_submissions,
)

INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."  # verl's words


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture()
def tool() -> Gsm8kTool:
    return load_tool_set(GSM8K_TOOLS_PATH).tools["calc_gsm8k_reward"]


@pytest.fixture()
def interaction() -> Gsm8kInteraction:
    return load_interactions(GSM8K_INTERACTIONS_PATH)["gsm8k"]


def test_verl_yamls_renamed_name_the_shipped_classes(tool, interaction):
    assert type(tool) is Gsm8kTool and type(interaction) is Gsm8kInteraction
    assert tool.tool_schema.function.parameters.required == ["answer"]


# submissions of one trajectory (ground truth "72") -> what verl's tool says to each: the answer as given, its
# score (flexible: the last number of "#### <answer>"), and the step reward (-0.05 unless the score went up)
TOOL_CASES = {
    "right at once": [("72", "'72'", 1.0, 0.0)],
    "wrong then right": [("71", "'71'", 0.0, -0.05), ("72", "'72'", 1.0, 0.0)],
    "right twice": [("72", "'72'", 1.0, 0.0), ("72", "'72'", 1.0, -0.05)],
    "right then wrong": [("72", "'72'", 1.0, 0.0), ("7", "'7'", 0.0, -0.05)],
    "a number, not a string": [(72, "'72'", 1.0, 0.0)],
    "already marked": [("#### 72", "'#### 72'", 1.0, 0.0)],
    "the last number counts": [("72 apples, not 73", "'72 apples, not 73'", 0.0, -0.05)],
    "commas in the number": [("1,072", "'1,072'", 0.0, -0.05)],
    "no number": [("seventy-two", "'seventy-two'", 0, -0.05)],  # no answer found: verl's scorer says 0, an int
}


@pytest.mark.parametrize("submissions", TOOL_CASES.values(), ids=TOOL_CASES.keys())
def test_gsm8k_tool_scores_submissions_as_verl(tool, submissions):
    async def play():
        instance_id, response = await tool.create("trajectory", ground_truth="72")
        assert (instance_id, response) == ("trajectory", ToolResponse())
        assert await tool.calc_reward(instance_id) == 0
        for answer, shown, reward, step_reward in submissions:
            result = await tool.execute(instance_id, {"answer": answer})
            assert result == (ToolResponse(text=f"Current parsed answer={shown} reward={reward}"), step_reward, {})
            assert await tool.calc_reward(instance_id) == reward
        await tool.release(instance_id)
        with pytest.raises(KeyError):
            await tool.calc_reward(instance_id)

    run(play())


def test_gsm8k_tool_instances_are_separate_and_take_verls_create_forms(tool):
    async def play():
        fresh, _ = await tool.create(ground_truth="5")  # no id: verl makes one
        nested, _ = await tool.create("nested", create_kwargs={"ground_truth": "6"})  # the row's spec passed whole
        assert fresh not in ("", None, "nested")
        await tool.execute(fresh, {"answer": "5"})
        await tool.execute(nested, {"answer": "5"})
        assert (await tool.calc_reward(fresh), await tool.calc_reward(nested)) == (1.0, 0.0)

    run(play())


def conversation(*assistant_turns: str) -> list[dict]:
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 4 more."}]
    for turn in assistant_turns:
        messages += [{"role": "assistant", "content": turn}, {"role": "user", "content": INCORRECT}]
    return messages[:-1]


# the model's turns so far -> verl's interaction's (ends the conversation, reply, score); strict: only "#### <n>" counts
INTERACTION_CASES = {
    "right": (["#### 7"], (True, "Your response is correct!", 1.0, {})),
    "wrong": (["#### 8"], (False, INCORRECT, 0.0, {})),
    "unmarked": (["the answer is 7"], (False, INCORRECT, 0, {})),
    "the last turn counts": (["#### 7", "#### 8"], (False, INCORRECT, 0.0, {})),
    "right on the second try": (["#### 8", "so 3 + 4 = 7\n#### 7"], (True, "Your response is correct!", 1.0, {})),
    "commas dropped": (["#### 1,007"], (False, INCORRECT, 0.0, {})),
}


@pytest.mark.parametrize("turns, expected", INTERACTION_CASES.values(), ids=INTERACTION_CASES.keys())
def test_gsm8k_interaction_replies_and_ends_as_verl(interaction, turns, expected):
    async def play():
        instance_id = await interaction.start_interaction("conversation", ground_truth="7", query="ignored")
        assert instance_id == "conversation" and await interaction.calculate_score(instance_id) == 0
        reply = await interaction.generate_response(instance_id, conversation(*turns))
        assert reply == expected
        assert await interaction.calculate_score(instance_id) == expected[2]
        await interaction.finalize_interaction(instance_id)
        with pytest.raises(KeyError):
            await interaction.calculate_score(instance_id)

    run(play())


def test_gsm8k_interaction_without_an_id_makes_one(interaction):
    async def play():
        first = await interaction.start_interaction(ground_truth="1")
        second = await interaction.start_interaction(ground_truth="2")
        assert first != second
        assert (await interaction.generate_response(first, conversation("#### 1")))[0] is True
        assert (await interaction.generate_response(second, conversation("#### 1")))[0] is False

    run(play())


def test_rollout_trace_op_keeps_the_function_as_it_is():
    class Tool:
        @rollout_trace_op
        async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
            return instance_id, parameters, kwargs

        @rollout_trace_op
        def name(self, prefix: str = "tool") -> str:
            return prefix + "!"

    assert inspect.iscoroutinefunction(Tool.execute) and not inspect.iscoroutinefunction(Tool.name)
    assert list(inspect.signature(Tool.execute).parameters) == ["self", "instance_id", "parameters", "kwargs"]
    assert run(Tool().execute("a", {"b": 1}, c=2)) == ("a", {"b": 1}, {"c": 2})
    assert Tool().name() == "tool!" and Tool.name.__name__ == "name"
    assert inspect.iscoroutinefunction(Gsm8kTool.execute)  # verl's tool applies it to its execute


def example_manager(config_name: str, model: str, *overrides: str) -> AgentLoopManager:
    """A manager for one of verl's GSM8K example configs, renamed, as its run script starts it, sized for a CPU."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is not available")  # hydra, on verl's absent search path
        config = compose_config(
            [
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.rollout.name=hf",
                "data.max_response_length=256",
                "actor_rollout_ref.rollout.agent.num_workers=0",
                "actor_rollout_ref.rollout.request_timeout_s=120",
                "actor_rollout_ref.rollout.server_startup_timeout_s=300",
                "trainer.n_gpus_per_node=1",
                *overrides,
            ],
            config_name=config_name,
            config_dir=VERL_JOB_CONFIG,
        )
    return AgentLoopManager(config)


def test_verls_gsm8k_tool_example_rolls_out_with_the_rename_only(local_ray, gsm8k_model):
    rows = gsm8k_example_rows()["tool"]
    manager = example_manager(
        "gsm8k_multiturn_grpo", gsm8k_model, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={GSM8K_TOOLS_PATH}"
    )
    try:
        batch = manager.generate_sequences(rows, validate=True)  # greedy: the model replays what it was taught
    finally:
        manager.shutdown()
    columns = batch.non_tensor_batch
    for i, row in enumerate(rows):
        submissions = gsm8k_submissions(row)
        assert columns["end_reason"][i] == "stop"
        turns = columns["turns"][i]
        calls = [call for turn in turns for call in turn.calls]
        # every submission reached the tool, which answered as verl's: a wrong one first costs 0.05, a right one nothing
        assert [(call.name, call.arguments, call.error) for call in calls] == [
            ("calc_gsm8k_reward", {"answer": answer}, None) for answer in submissions
        ]
        rewards = [1.0 if answer == row["reward_model"]["ground_truth"] else 0.0 for answer in submissions]
        assert [call.result for call in calls] == [
            f"Current parsed answer='{answer}' reward={reward}" for answer, reward in zip(submissions, rewards)
        ]
        assert [turn.step_reward for turn in turns] == [0.0 if reward else -0.05 for reward in rewards] + [0.0]
        # released with its calc_reward reported, and the row scored by verl's gsm8k scorer on "#### <answer>"
        assert columns["reward_parts"][i].tools == {"calc_gsm8k_reward": 1.0}
        assert columns["reward_score"][i] == 1.0


def test_verls_gsm8k_interaction_example_rolls_out_with_the_rename_only(local_ray, gsm8k_model):
    rows = gsm8k_example_rows()["interaction"]
    manager = example_manager(
        "gsm8k_multiturn_grpo_w_interaction",
        gsm8k_model,
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={GSM8K_INTERACTIONS_PATH}",
    )
    try:
        batch = manager.generate_sequences(rows, validate=True)
    finally:
        manager.shutdown()
    columns = batch.non_tensor_batch
    for i, row in enumerate(rows):
        rewards = [1.0 if answer == row["reward_model"]["ground_truth"] else 0.0 for answer in gsm8k_submissions(row)]
        # the interaction graded each answer, told the model a wrong one was wrong, and ended at the right one
        assert columns["end_reason"][i] == "stop"
        assert [turn.interaction_score for turn in columns["turns"][i]] == rewards
        assert list(columns["observation_roles"][i]) == ["user"] * (len(rewards) - 1)
        assert columns["reward_parts"][i].interaction == 1.0 and columns["reward_score"][i] == 1.0
    # the second row's answer was wrong first: verl's reply to it is in the response, as a user turn
    tokenizer = AutoTokenizer.from_pretrained(gsm8k_model)
    width = batch.batch["responses"].shape[1]
    lengths = batch.batch["attention_mask"][:, -width:].sum(dim=1).tolist()
    responses = [tokenizer.decode(ids[:length]) for ids, length in zip(batch.batch["responses"], lengths)]
    assert INCORRECT not in responses[0] and f"<|im_start|>user\n{INCORRECT}<|im_end|>" in responses[1]
