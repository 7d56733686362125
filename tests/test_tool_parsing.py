"""Parsers, observation deltas, the tokenization sanity check, tool config errors, built-in tools and data."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentloop.agent_loop.trajectory import Trajectory, observation_delta
from agentloop.protocol import TokenOutput
from agentloop.rows import write_rows
from agentloop.server.http.chat import completion_choice, token_spelling
from agentloop.tasks.arithmetic.data import make_rows
from agentloop.tasks.arithmetic.tools import evaluate
from agentloop.tools.parsers import get_parser, parse_hermes, parse_qwen3_coder
from agentloop.tools.reasoning import ReasoningSplit, prompt_opens_reasoning, split_reasoning
from agentloop.tools.schemas import ToolCall
from agentloop.tools.toolset import load_tool_set

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def test_hermes_round_trip_through_the_chat_template(tokenizer):
    calls = [
        {"name": "calculator", "arguments": {"expression": "2 + 3"}},
        {"name": "calculator", "arguments": {"expression": "7"}},
    ]
    message = {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [{"type": "function", "function": c} for c in calls],
    }
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, message], tokenize=False)
    turn = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, parsed = parse_hermes(turn)
    assert content == "Let me compute."
    assert [(c.name, c.arguments) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]


def test_calls_inside_think_are_ignored():
    text = '<think>\nmaybe <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n</think>\n\nno call'
    assert parse_hermes(text) == ("no call", [])
    # an unclosed <think> hides everything after it
    assert parse_hermes('<think>\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')[1] == []
    qwen = "<think><tool_call>\n<function=a>\n</function>\n</tool_call></think>"
    assert parse_qwen3_coder(qwen)[1] == []


@pytest.mark.parametrize("parse", [parse_hermes, parse_qwen3_coder])
def test_a_reply_without_a_call_is_its_content_exactly_whether_tools_were_offered_or_not(tokenizer, parse):
    text = "\n  The answer is 5.  \n\n"
    assert parse(text) == (text, [])
    # the gateway's choice (and the rollout server's): the client gets the same content with tools offered or not
    ids = [*tokenizer.encode(text), tokenizer.eos_token_id]
    output = TokenOutput(token_ids=ids, log_probs=[0.0] * len(ids), finish_reason="stop")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, return_dict=False
    )
    spell = token_spelling(tokenizer)
    offered, not_offered = (completion_choice(output, prompt, tokenizer, p, spell)["message"] for p in (parse, None))
    assert offered == not_offered and offered["content"] == text


@pytest.mark.parametrize(
    "text, opened, split",
    [
        # no reasoning, or a closing tag the prompt did not open: unchanged, as with non-thinking templates
        ("Sure.\n<tool_call>x</tool_call>\n", False, (None, "Sure.\n<tool_call>x</tool_call>\n")),
        ("a <tool_call>x</tool_call></think>b", False, (None, "a <tool_call>x</tool_call></think>b")),
        # reasoning the model opened itself, closed or not
        ("<think>\nplan\n</think>\n\nanswer", False, ("plan", "answer")),
        ("<think>\nplan <tool_call>x", False, ("plan <tool_call>x", "")),
        # reasoning the prompt opened: up to the first closing tag, or all of a turn cut off inside it
        ("plan <tool_call>x</tool_call>\n</think>\n\nanswer", True, ("plan <tool_call>x</tool_call>", "answer")),
        ("plan <tool_call>x</tool_call>", True, ("plan <tool_call>x</tool_call>", "")),
        ("<think>\nplan</think>ok", True, ("plan", "ok")),
        ("\n</think>\n\nok", True, (None, "ok")),
    ],
)
def test_split_reasoning(text, opened, split):
    assert split_reasoning(text, opened=opened) == ReasoningSplit(*split)


def test_hermes_faults_are_reported_not_raised():
    assert parse_hermes("<tool_call>\n{bad json\n</tool_call>")[1][0].error.startswith("malformed JSON")
    assert "expected" in parse_hermes('<tool_call>\n["x"]\n</tool_call>')[1][0].error
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][0].arguments == {"x": 1}
    # a call cut off by the token budget still shows up, as an unparsable call
    assert parse_hermes('<tool_call>\n{"name": "f", "argum')[1][0].error is not None


def test_qwen3_coder_round_trip():
    text = (
        "Sure.\n<tool_call>\n<function=calculator>\n<parameter=expression>\n2 + 3\n</parameter>\n"
        "<parameter=precision>\n4\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = parse_qwen3_coder(text)
    assert content == "Sure." and calls == [
        ToolCall(name="calculator", arguments={"expression": "2 + 3", "precision": 4})
    ]
    assert get_parser("qwen3_coder") is parse_qwen3_coder
    with pytest.raises(KeyError, match=r"unknown multi_turn.format 'nope'; registered tool-call parsers: \['hermes'"):
        get_parser("nope")


def _model_turn(tokenizer, text: str) -> TokenOutput:
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    return TokenOutput(ids, [-0.5] * len(ids), "stop")


@pytest.mark.parametrize("template", ["ours", "qwen3"])
def test_a_turn_stopped_by_another_stop_id_is_closed_with_the_end_of_turn_token(model_path, template):
    # Qwen's generation configs stop on <|endoftext|> as well as on <|im_end|>, the template's end of turn
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if template == "qwen3":
        if not QWEN3_CONFIG.exists():
            pytest.skip("../shared/fixtures/qwen3 is not present")
        tokenizer.chat_template = json.loads(QWEN3_CONFIG.read_text())["chat_template"]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    other_stop = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other_stop != tokenizer.eos_token_id
    for last, closing in ((tokenizer.eos_token_id, []), (other_stop, [tokenizer.eos_token_id])):
        trajectory = Trajectory(tokenizer, messages, prompt, TOOLS)
        call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
        ids = tokenizer.encode(call) + [last]
        assert trajectory.add_model_turn(TokenOutput(ids, [-0.5] * len(ids), "stop")) == call
        tool = [{"role": "tool", "content": "5"}]
        observation = trajectory.observation(tool)
        assert observation.ids == closing + observation_delta(tokenizer, tool)
        trajectory.add_observation(observation)
        assert trajectory.response_mask == [1] * len(ids) + [0] * len(
            observation.ids
        )  # the closing token is not the model's


def test_delta_tokens_equal_the_full_render_and_sanity_check_modes(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    trajectory = Trajectory(tokenizer, messages, prompt, TOOLS)
    call = '<think>\nadd\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    trajectory.add_model_turn(_model_turn(tokenizer, call))
    tool = [{"role": "tool", "content": "5"}]
    trajectory.add_observation(trajectory.observation(tool))
    trajectory.add_model_turn(_model_turn(tokenizer, "<think>\nok\n</think>\n\nIt is 5."))
    # no system/tools preamble in the delta, and the incremental ids equal one full render
    assert "<tools>" not in tokenizer.decode(observation_delta(tokenizer, tool))
    full = tokenizer.apply_chat_template(trajectory.messages, tools=TOOLS, tokenize=True, return_dict=False)
    assert trajectory.ids == full[: len(trajectory.ids)] and full[len(trajectory.ids) :] == tokenizer.encode("\n")
    assert trajectory.sanity_check("strict") == 0

    # A new user turn makes the template strip <think> from the earlier turns: the full render no
    # longer matches the tokens the model actually saw. strict reports it, ignore_strippable does not.
    user = [{"role": "user", "content": "And 3 + 4?"}]
    trajectory.add_observation(trajectory.observation(user))
    trajectory.add_model_turn(_model_turn(tokenizer, "7"))
    before = list(trajectory.ids)
    assert trajectory.sanity_check("strict") >= 1
    assert trajectory.sanity_check("ignore_strippable") == 0
    assert trajectory.sanity_check("disable") == 0
    assert trajectory.ids == before
    with pytest.raises(ValueError, match="tokenization_sanity_check_mode='loose'"):
        trajectory.sanity_check("loose")


@pytest.mark.parametrize(
    "content, message",
    [
        ("tools:\n  - config: {}\n", r"tools\[0\]: missing field 'class_name'"),
        ("tools:\n  - class_name: no.such.Tool\n", r"tools\[0\].class_name = 'no.such.Tool' cannot be imported"),
        (
            "tools:\n  - class_name: agentloop.protocol.TokenOutput\n",
            r"is not a subclass of agentloop.tools.base_tool.BaseTool",
        ),
        (
            "tools:\n  - class_name: agentloop.tasks.arithmetic.tools.CalculatorTool\n    tool_schema: {type: function, function: {description: x}}\n",
            r"tools\[0\].tool_schema.function.name: Field required",
        ),
        ("- a\n", r"expected a mapping with a 'tools' list"),
    ],
)
def test_bad_tool_config_names_file_and_field(tmp_path, content, message):
    path = tmp_path / "tools.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        load_tool_set(str(path))
    assert str(path) in str(error.value)


def test_calculator_and_answer_tools(tmp_path):
    assert evaluate("12 * (3 + 4) - 5 / 5") == 83
    with pytest.raises(ValueError):
        evaluate("__import__('os')")
    tool_set = load_tool_set("config/tools/arithmetic.yaml")
    assert [s["function"]["name"] for s in tool_set.schemas] == ["calculator", "submit_answer"]

    async def scenario():
        created: dict[str, asyncio.Future] = {}
        kwargs = {"submit_answer": {"ground_truth": 12}}
        calc = await tool_set.call(
            ToolCall(name="calculator", arguments={"expression": "3 * 4"}), "t1", created, kwargs
        )
        answer = await tool_set.call(ToolCall(name="submit_answer", arguments={"answer": 12}), "t1", created, kwargs)
        return calc, answer, await tool_set.finish("t1", created)

    calc, answer, rewards = asyncio.run(scenario())
    assert calc.text == "12" and answer.text == "correct" and rewards == {"calculator": 0.0, "submit_answer": 1.0}


def test_arithmetic_dataset_rows(tmp_path):
    rows = make_rows(16, seed=3)
    assert rows == make_rows(16, seed=3) and rows != make_rows(16, seed=4)
    row = rows[0]
    assert row["agent_name"] == "tool_agent" and row["data_source"] == "arithmetic"
    a, op, b = row["extra_info"]["expression"].split()
    assert str(evaluate(f"{a} {op} {b}")) == row["reward_model"]["ground_truth"]
    assert row["extra_info"]["tools_kwargs"]["submit_answer"]["create_kwargs"]["ground_truth"] == int(
        row["reward_model"]["ground_truth"]
    )
    import pyarrow.parquet as pq

    assert pq.read_table(write_rows(rows, str(tmp_path / "train.parquet"))).to_pylist() == rows
    assert [json.loads(line) for line in open(write_rows(rows, str(tmp_path / "t.jsonl")))] == rows


@pytest.mark.parametrize("long_episodes", [False, True])
def test_the_warm_start_solutions_are_answered_by_the_real_tools_as_taught(long_episodes):
    """Every call the warm start teaches parses, the task's tools reply with the observation it was taught, and the
    episode scores 1; the long episodes (``benchmarks/vs_trl`` (c)) take four model turns, each with text."""
    from agentloop.tasks.arithmetic.warm_start import conversation

    tool_set = load_tool_set("config/tools/arithmetic.yaml")

    async def solve(row: dict) -> int:
        chat = conversation(row, True, random.Random(0), long_episodes=long_episodes)[len(row["prompt"]) :]
        kwargs = {name: spec["create_kwargs"] for name, spec in row["extra_info"]["tools_kwargs"].items()}
        instance, created = f"row-{row['extra_info']['index']}", {}
        for message, reply in zip(chat[0::2], chat[1::2]):  # (assistant call, taught tool reply) pairs
            text, (call,) = parse_hermes(message["content"])
            assert bool(text.strip()) == long_episodes
            assert (await tool_set.call(call, instance, created, kwargs)).text == reply["content"]
        assert (await tool_set.finish(instance, created))["submit_answer"] == 1.0
        assert parse_hermes(chat[-1]["content"])[1] == []  # the closing turn calls nothing
        return len(chat[0::2])

    async def solve_all() -> list[int]:
        return await asyncio.gather(*(solve(row) for row in make_rows(8, split="warm_start")))

    assert asyncio.run(solve_all()) == [4 if long_episodes else 3] * 8


QWEN3_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "qwen3" / "tokenizer_config.json"


@pytest.mark.skipif(not QWEN3_CONFIG.exists(), reason="../shared/fixtures/qwen3 is not present")
def test_delta_tokens_with_qwen3s_own_template(model_path):
    # Qwen3's template on our tokenizer (same ChatML special tokens): its hazards are in the template.
    # This variant opens "<think>\n" in the generation prompt, so model turns start inside reasoning.
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = json.loads(QWEN3_CONFIG.read_text())["chat_template"]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    trajectory = Trajectory(tokenizer, messages, prompt, TOOLS)
    call = 'add\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    trajectory.add_model_turn(_model_turn(tokenizer, call))
    tool = [{"role": "tool", "content": "5"}]
    delta = trajectory.observation(tool)
    expected = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tokenizer.decode(delta.ids) == expected
    trajectory.add_observation(delta)
    trajectory.add_model_turn(_model_turn(tokenizer, "ok\n</think>\n\nIt is 5."))
    full = tokenizer.apply_chat_template(trajectory.messages, tools=TOOLS, tokenize=True, return_dict=False)
    assert trajectory.ids == full[: len(trajectory.ids)]
    assert trajectory.sanity_check("strict") == 0
    # a new user query makes Qwen3 drop the reasoning of every earlier turn from its re-render
    user = [{"role": "user", "content": "And 3 + 4?"}]
    trajectory.add_observation(trajectory.observation(user))
    trajectory.add_model_turn(_model_turn(tokenizer, "\n</think>\n\n7"))
    assert trajectory.sanity_check("strict") >= 1
    assert trajectory.sanity_check("ignore_strippable") == 0


@pytest.mark.skipif(not QWEN3_CONFIG.exists(), reason="../shared/fixtures/qwen3 is not present")
def test_template_kwargs_reach_every_render(model_path):
    # data.apply_chat_template_kwargs={enable_thinking: false}: the prompt and each observation delta end
    # in the closed empty reasoning, so the model answers outside it, and the re-render agrees. The fixture
    # is a thinking-only Qwen3; the hybrid Qwen3 models add this switch to its generation prompt.
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    thinking_only = json.loads(QWEN3_CONFIG.read_text())["chat_template"]
    opening = "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    assert opening in thinking_only
    tokenizer.chat_template = thinking_only.replace(
        opening,
        (
            "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
        ),
    )
    off = {"enable_thinking": False}
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, **off
    )
    assert tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(
        tokenizer, prompt
    )
    trajectory = Trajectory(tokenizer, messages, prompt, TOOLS, off)
    trajectory.add_model_turn(
        _model_turn(
            tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
        )
    )
    tool = [{"role": "tool", "content": "5"}]
    delta = trajectory.observation(tool)
    assert tokenizer.decode(delta.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert delta.ids != observation_delta(tokenizer, tool)  # without the kwargs the delta would open the reasoning
    trajectory.add_observation(delta)
    trajectory.add_model_turn(_model_turn(tokenizer, "It is 5."))
    # Qwen3 re-renders an earlier turn without its empty reasoning block: only whitespace and think tags differ
    assert trajectory.sanity_check("ignore_strippable") == 0


@pytest.mark.skipif(not QWEN3_CONFIG.exists(), reason="../shared/fixtures/qwen3 is not present")
def test_prompt_opens_reasoning_only_with_a_thinking_template(tokenizer, model_path):
    messages = [{"role": "user", "content": "q"}]
    render = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    assert not prompt_opens_reasoning(tokenizer, tokenizer.apply_chat_template(messages, **render))
    qwen3 = AutoTokenizer.from_pretrained(model_path)
    qwen3.chat_template = json.loads(QWEN3_CONFIG.read_text())["chat_template"]
    prompt = qwen3.apply_chat_template(messages, **render)
    assert prompt_opens_reasoning(qwen3, prompt)
    # an empty reasoning the template closed itself (thinking switched off) leaves the turn outside it
    assert not prompt_opens_reasoning(qwen3, prompt + qwen3.encode("\n</think>\n\n"))


def test_parallel_calls_of_one_tool_share_one_creation(tmp_path):
    from tests.support import probe_tools

    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - class_name: tests.support.probe_tools.SlowCreateTool\n"
        "    tool_schema: {type: function, function: {name: slow}}\n"
    )
    tool_set = load_tool_set(str(path))

    async def scenario():
        created: dict[str, asyncio.Future] = {}
        results = await asyncio.gather(
            *(tool_set.call(ToolCall(name="slow", arguments={}), "i", created, {}) for _ in range(3))
        )
        return results, await tool_set.finish("i", created)

    results, rewards = asyncio.run(scenario())
    assert (
        [r.text for r in results] == ["ok"] * 3 and probe_tools.SlowCreateTool.creates == 1 and rewards == {"slow": 0.0}
    )
