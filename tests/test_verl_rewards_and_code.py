"""verl's rewards, rows and user code, piece by piece: the built-in scorers against hand-worked cases,
the reward rule for every loop, verl's row fields, tool classes written for verl, and the checks that
run before any server starts."""

from __future__ import annotations

import asyncio
import logging
import textwrap

import pytest
from omegaconf import open_dict
from transformers import AutoTokenizer

from agentloop.agent_loop import AgentLoopBase, DictConfigWrap
from agentloop.preflight import check_job
from agentloop.protocol import AgentLoopOutput, RewardParts, SampleScore
from agentloop.reward_score import default_compute_score, gsm8k, math_reward
from agentloop.rewards import score_output
from agentloop.settings import reward_settings
from agentloop.rows import verl_row_fields, write_rows
from agentloop.tools.base_tool import BaseTool
from agentloop.tools.schemas import (
    OpenAIFunctionParametersSchema,
    OpenAIFunctionPropertySchema,
    OpenAIFunctionToolSchema,
)
from agentloop.tools.toolset import argument_validator, checked_arguments, load_tool_set
from tests.support.config import small_config
from tests.support.verl_job import data as verl_data
from trainer.main_ppo import run

VERL_JOB = "tests/support/verl_job/config"


@pytest.mark.parametrize(
    "text, method, expected",
    [
        ("so 3 + 4 = 7\n#### 7", "strict", 1.0),
        ("#### 1,007", "strict", 0.0),  # commas dropped: "1007" is not "7"
        ("#### 5 then #### 7", "strict", 1.0),  # the last marked answer counts
        ("the answer is 7", "strict", 0),  # strict needs the #### mark
        ("the answer is 7", "flexible", 1.0),
        ("7 apples, not 8.", "flexible", 0.0),  # the last number, not the first
        ("#### 7" + " padding" * 60, "strict", 0),  # only the last 300 characters are searched
        ("#### -7", "strict", 0.0),
    ],
)
def test_gsm8k_scores_as_verl_does(text, method, expected):
    assert gsm8k.compute_score(text, "7", method=method) == expected


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        (r"so \boxed{\frac12}", r"\frac{1}{2}", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{5 \text{ cm}}", "5", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"first \boxed{2}, finally \boxed{\sqrt{2}}", r"\sqrt2", 1.0),
        (r"\fbox{7}", "7", 0.0),  # verl only unboxes \boxed
        (r"\boxed 7$", "7", 1.0),
        ("no box: 7", "7", 0.0),
        (r"\boxed{8}", "7", 0.0),
    ],
)
def test_boxed_math_scores_as_verl_does(text, truth, expected):
    assert math_reward.compute_score(text, truth) == expected


def test_unknown_data_source_names_the_fix():
    with pytest.raises(NotImplementedError, match=r"custom_reward_function.path and .name"):
        default_compute_score("my/dataset", "x", "y")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def scored(config, tokenizer, row, output):
    """The output, scored, and the worker's record of its scoring (``SampleScore``)."""
    return output, asyncio.run(score_output(reward_settings(config), tokenizer, row, output))


def test_reward_rule_for_every_loop(tokenizer, tmp_path):
    response = tokenizer.encode("#### 7", add_special_tokens=False) + [tokenizer.eos_token_id]
    gsm8k_row = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 3}}

    def output(**fields):
        return AgentLoopOutput([1, 2], list(response), [1] * len(response), None, **fields)

    # a plain single-turn sample gets the built-in scorer for its data source, on the decoded response
    plain, plain_score = scored(small_config(), tokenizer, gsm8k_row, output())
    assert plain.reward_score == 1.0 and plain_score == SampleScore("reward_function", {"acc": 1.0})
    # the scoring is the worker's record: the loop's output holds only what the loop produced
    assert plain.reward_extra_info == {}
    # verl's loops may keep no log-probs; the record says so, and the loop's own extra_fields stay its own
    assert plain.rollout_log_probs_missing and plain.extra_fields == {}
    # a loop's own parts (here a tool's calc_reward) do not change a data-source reward; they are reported
    with_tool, _ = scored(small_config(), tokenizer, gsm8k_row, output(reward_parts=RewardParts(tools={"calc": 0.25})))
    assert with_tool.reward_score == 1.0 and with_tool.reward_parts.by_source() == {"tool/calc": 0.25}
    # without a reward function the parts add up; a loop that set its reward keeps it
    unknown = {"data_source": "mine"}
    parts, parts_score = scored(
        small_config(), tokenizer, unknown, output(reward_parts=RewardParts(tools={"a": 0.5}, interaction=1.0))
    )
    assert parts.reward_score == 1.5 and parts_score.reward_source == "reward_parts"
    # a loop's own key in extra_fields is carried, never read as a reward part
    own, own_score = scored(small_config(), tokenizer, unknown, output(extra_fields={"tool_rewards": {"a": 0.5}}))
    assert own.reward_score is None and own_score.reward_source == "none"
    assert own.extra_fields == {"tool_rewards": {"a": 0.5}}
    # a loop that scored the sample keeps its reward, and what it returned beside it is the sample's extra info
    kept, kept_score = scored(
        small_config(), tokenizer, gsm8k_row, output(reward_score=-2.0, reward_extra_info={"mine": 1.0})
    )
    assert kept.reward_score == -2.0 and kept_score == SampleScore("agent_loop", {"mine": 1.0})
    assert scored(small_config(), tokenizer, unknown, output())[0].reward_score is None

    # verl's custom_reward_function.path / .name / .reward_kwargs, sync or async, for every data source
    (tmp_path / "my_reward.py").write_text(
        textwrap.dedent("""
        import asyncio

        def judge(data_source, solution_str, ground_truth, extra_info, scale=1.0):
            return {"score": scale * len(solution_str), "turns": extra_info["num_turns"],
                    "parts": extra_info["rollout_reward_scores"], "index": extra_info["index"]}

        async def slow(data_source, solution_str, ground_truth, extra_info):
            await asyncio.sleep(30)
    """)
    )
    custom = small_config(
        f"custom_reward_function.path={tmp_path / 'my_reward.py'}",
        "custom_reward_function.name=judge",
        "+custom_reward_function.reward_kwargs.scale=2.0",
    )
    judged, judged_score = scored(
        custom, tokenizer, gsm8k_row, output(num_turns=4, reward_parts=RewardParts(tools={"a": 0.5}))
    )
    assert judged.reward_score == 2.0 * len("#### 7")  # special tokens are skipped, as verl decodes
    assert judged_score.reward_extra_info == {"score": 12.0, "turns": 4, "parts": {"tool/a": 0.5}, "index": 3}
    # by_data_source wins over path
    routed = small_config(
        f"custom_reward_function.path={tmp_path / 'my_reward.py'}", "custom_reward_function.name=judge"
    )
    with open_dict(routed):
        routed.custom_reward_function.by_data_source["openai/gsm8k"] = (
            "agentloop.tasks.arithmetic.reward.arithmetic_score"
        )
    assert scored(routed, tokenizer, gsm8k_row, output())[1].reward_extra_info["answer_found"] == 1.0
    bounded = small_config(
        f"custom_reward_function.path={tmp_path / 'my_reward.py'}",
        "custom_reward_function.name=slow",
        "custom_reward_function.timeout_s=0.2",
    )
    with pytest.raises(TimeoutError, match="custom_reward_function.timeout_s=0.2"):
        scored(bounded, tokenizer, gsm8k_row, output())
    missing = small_config(f"custom_reward_function.path={tmp_path / 'nope.py'}")
    with pytest.raises(FileNotFoundError, match="nope.py"):
        scored(missing, tokenizer, gsm8k_row, output())


def test_a_row_without_a_data_source_falls_to_the_next_rule(tokenizer, tmp_path, caplog):
    """With ``by_data_source`` set, a row that has no ``data_source`` is scored by ``custom_reward_function.path`` (the
    only rule verl has), or by the loop's parts without one; the checks before start warn about it, never crash."""
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return float(len(solution_str))\n"
    )
    by_source = "+custom_reward_function.by_data_source.arith=agentloop.tasks.arithmetic.reward.arithmetic_score"
    response = tokenizer.encode("#### 7", add_special_tokens=False) + [tokenizer.eos_token_id]
    no_source = {"prompt": [{"role": "user", "content": "q"}], "extra_info": {}}

    def output():
        return AgentLoopOutput([1, 2], list(response), [1] * len(response), None, reward_parts=RewardParts(env=0.5))

    with_path = small_config(by_source, f"custom_reward_function.path={tmp_path / 'length_reward.py'}")
    scored_by_path, by_path_score = scored(with_path, tokenizer, no_source, output())
    assert by_path_score.reward_source == "reward_function" and scored_by_path.reward_score == len("#### 7")
    only_by_source = small_config(by_source)
    by_parts, by_parts_score = scored(only_by_source, tokenizer, no_source, output())
    assert by_parts_score.reward_source == "reward_parts" and by_parts.reward_score == 0.5
    with caplog.at_level(logging.WARNING, logger="agentloop.preflight"):
        check_job(only_by_source, {"train": [no_source]})
    assert "no reward function for data_source ['None']" in caplog.text
    check_job(with_path, {"train": [no_source]})


def test_rows_get_verl_fields():
    row = verl_data.tool_rows("train", 1, seed=0)[0]
    fields = verl_row_fields(row)
    assert fields["raw_prompt"] == row["prompt"] and fields["index"] == 0
    assert fields["tools_kwargs"] == row["extra_info"]["tools_kwargs"]
    assert fields["interaction_kwargs"] == row["extra_info"]["interaction_kwargs"]
    assert verl_row_fields({**row, "tools_kwargs": {"own": {}}})["tools_kwargs"] == {"own": {}}


def test_tool_classes_written_for_verl():
    assert sorted(load_tool_set(f"{VERL_JOB}/tool_config/gsm8k_tool_config.yaml").tools) == ["calc_gsm8k_reward"]
    # an entry without tool_schema takes its class's schema
    assert sorted(load_tool_set(f"{VERL_JOB}/tool_config/schema_from_class_tool_config.yaml").tools) == ["check_answer"]

    class Renamed(BaseTool):
        def __init__(self, config, tool_schema):
            super().__init__(config, tool_schema)
            self.name = "renamed"

    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": OpenAIFunctionParametersSchema(
                    properties={"a": OpenAIFunctionPropertySchema(type="integer")}, required=["a"]
                ),
            },
        }
    )
    assert Renamed({}, schema).name == "renamed"
    assert schema.function.parameters.properties == {"a": {"type": "integer"}}
    with pytest.raises(ValueError, match="has no schema"):
        BaseTool({}, None)
    # arguments that fail the schema only by a lossless type are converted
    parameters = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}}}
    validator = argument_validator(parameters)
    assert checked_arguments({"answer": 105, "n": "3"}, validator) == {"answer": "105", "n": 3}
    assert checked_arguments({"answer": "x"}, validator) == {"answer": "x"}
    with pytest.raises(Exception, match="is not of type 'integer'"):
        checked_arguments({"n": "3.5"}, validator)


def test_apply_chat_template_as_in_verl(tokenizer):
    loop = AgentLoopBase(
        DictConfigWrap(small_config()), None, tokenizer, None, None, DictConfigWrap(small_config().data)
    )
    messages = [{"role": "user", "content": "hi"}]
    ids = asyncio.run(loop.apply_chat_template(messages))
    assert ids == loop.encode_prompt(messages)
    assert (
        asyncio.run(loop.apply_chat_template(messages, remove_system_prompt=True)) == ids
    )  # no default system prompt here
    with pytest.raises(ValueError, match="vision-language"):
        asyncio.run(loop.apply_chat_template(messages, images=["picture"]))


def test_job_problems_are_named_before_anything_starts(tmp_path):
    rows = verl_data.interaction_rows("train", 2, seed=0)
    rows[0]["agent_name"] = "no_such_loop"
    rows[1]["extra_info"]["interaction_kwargs"]["name"] = "tutor"
    train = write_rows(rows, str(tmp_path / "train.parquet"))
    bad_tools = tmp_path / "tools.yaml"
    bad_tools.write_text(
        "tools:\n  - class_name: no.such.Tool\n    tool_schema: {type: function, function: {name: x}}\n"
    )
    config = small_config(
        f"data.train_files=[{train}]",
        "data.train_batch_size=2",
        "data.max_prompt_length=512",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={bad_tools}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={VERL_JOB}/interaction_config/gsm8k_interaction_config.yaml",
    )
    with pytest.raises(ValueError) as error:
        run(config)
    message = str(error.value)
    assert "the job cannot start" in message
    assert "unknown agent_name ['no_such_loop']" in message
    assert "tools.yaml: tools[0].class_name = 'no.such.Tool' cannot be imported" in message
    assert "1 row(s) have interaction_kwargs.name='tutor', not among the interactions" in message


def test_overlong_filter_measures_prompts_with_the_tool_schemas(tokenizer, tmp_path):
    rows = verl_data.tool_rows("train", 2, seed=0)
    train = write_rows(rows, str(tmp_path / "train.parquet"))
    plain = max(
        len(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for row in rows
    )
    fits_without_tools = [
        f"data.train_files=[{train}]",
        "data.train_batch_size=2",
        "data.filter_overlong_prompts=true",
        f"data.max_prompt_length={plain}",
    ]
    # every row fits as plain chat, and none once tool_agent's tool schemas are rendered with it
    with pytest.raises(ValueError, match=f"every row of .* is longer than data.max_prompt_length={plain}"):
        run(
            small_config(
                *fits_without_tools,
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={VERL_JOB}/tool_config/gsm8k_tool_config.yaml",
            )
        )
