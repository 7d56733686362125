"""Registry by decorator and by YAML file, and the errors a user sees for bad names and bad files."""

import pytest

from agentloop import AgentLoopBase, register
from agentloop.agent_loop.single_turn import SingleTurnAgentLoop
from agentloop.registry import build_agent_loop, check_agent_names, resolve_agent_loops


@register("echo_for_registry_test")
class EchoLoop(AgentLoopBase):
    def __init__(self, *, greeting: str = "hi", **kwargs):
        super().__init__(**kwargs)
        self.greeting = greeting


def _deps():
    from agentloop.config import compose_config

    return {"server_manager": object(), "tokenizer": object(), "config": compose_config()}


def test_decorator_and_builtin_registrations():
    specs = resolve_agent_loops()
    assert specs["single_turn_agent"]["_target_"] == "agentloop.agent_loop.single_turn.SingleTurnAgentLoop"
    assert isinstance(build_agent_loop(specs["single_turn_agent"], **_deps()), SingleTurnAgentLoop)
    loop = build_agent_loop(specs["echo_for_registry_test"], **_deps())
    assert isinstance(loop, EchoLoop) and loop.greeting == "hi"


def test_yaml_file_with_extra_kwargs(tmp_path):
    file = tmp_path / "loops.yaml"
    file.write_text(f"- name: polite_echo\n  _target_: {__name__}.EchoLoop\n  greeting: good morning\n")
    specs = resolve_agent_loops(str(file))
    loop = build_agent_loop(specs["polite_echo"], **_deps())
    assert isinstance(loop, EchoLoop) and loop.greeting == "good morning"
    assert loop.rollout.name == "hf"


def test_unknown_name_lists_registered_names():
    specs = resolve_agent_loops()
    with pytest.raises(
        KeyError, match=r"unknown agent_name \['nope'\]; registered agent loops: \[.*'single_turn_agent'"
    ):
        check_agent_names({"nope", "single_turn_agent"}, specs)


@pytest.mark.parametrize(
    "content, message",
    [
        ("- _target_: x.Y\n", r"entry 0: missing field 'name'"),
        ("- name: a\n", r"entry 0: missing field '_target_'"),
        (
            "- name: a\n  _target_: no_such_module.Loop\n",
            r"entry 0: field '_target_' = 'no_such_module.Loop' cannot be imported",
        ),
        ("name: a\n", r"expected a YAML list"),
    ],
)
def test_bad_yaml_names_file_and_field(tmp_path, content, message):
    file = tmp_path / "loops.yaml"
    file.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        resolve_agent_loops(str(file))
    assert str(file) in str(error.value)


def test_missing_yaml_file_names_the_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="agent_loop_config_path"):
        resolve_agent_loops(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("mode", ["left", "right", "error"])
def test_prompt_truncation_modes(model_path, mode):
    from transformers import AutoTokenizer

    from agentloop.config import compose_config

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = compose_config([f"data.truncation={mode}", "data.max_prompt_length=8"])
    loop = SingleTurnAgentLoop(server_manager=None, tokenizer=tokenizer, config=config)
    messages = [{"role": "user", "content": "a fairly long question about numbers"}]
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(full) > 8
    if mode == "error":
        with pytest.raises(ValueError, match=f"prompt has {len(full)} tokens.*data.truncation=left"):
            loop.encode_prompt(messages)
    else:
        expected = full[-8:] if mode == "left" else full[:8]
        assert loop.encode_prompt(messages) == expected


def test_a_prompt_rendered_once_per_worker_follows_its_tokenizer_template_and_kwargs(model_path):
    """The rendered prompt is kept for the group's other samples, and only for the same render: another template
    on the same tokenizer, other template kwargs or other messages render anew."""
    from transformers import AutoTokenizer

    from agentloop.config import compose_config

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = compose_config(["data.max_prompt_length=512"])
    loop = SingleTurnAgentLoop(server_manager=None, tokenizer=tokenizer, config=config)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]

    def render(**kwargs):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )

    first = loop.encode_prompt(messages)
    first.append(-1)  # a caller's list is its own: the kept render is not changed through it
    assert loop.encode_prompt(messages) == render()
    assert loop.encode_prompt([{"role": "user", "content": "What is 3 + 5?"}]) != render()
    loop.apply_chat_template_kwargs = {"custom_marker": True}
    tokenizer.chat_template = "{% if custom_marker %}marked {% endif %}{{ messages[0]['content'] }}"
    assert tokenizer.decode(loop.encode_prompt(messages)) == "marked What is 3 + 4?"
    loop.apply_chat_template_kwargs = {}
    assert tokenizer.decode(loop.encode_prompt(messages)) == "What is 3 + 4?"
