"""Context strategies and segments (``multi_turn.context``): every model turn is sampled under the exact context its
segment records, on a real engine; ``append`` is today's trajectory; Qwen3's template drops earlier reasoning."""

from __future__ import annotations

import asyncio
import functools

import pytest
import ray
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop.agent_loop.context import ContextStrategy, context_strategy, sliding_window
from agentloop.agent_loop.trajectory import Trajectory
from agentloop.dumps import mask_runs
from agentloop.images import expand_image_pads, process_images, split_images
from agentloop.models.loading import load_processor
from agentloop.protocol import AgentLoopOutput, Segment, TokenOutput
from agentloop.rewards import score_output
from agentloop.server.rollout_server import RolloutServer
from tests.support.config import small_config
from tests.support.models import script_row
from tests.support.ranks import manager_and_two_ranks, scores
from tests.support.thinking_model import QWEN3_CONFIG, with_qwen3_template
from tests.support.vision import picture, picture_message
from tests.test_tool_agent import run_loop, tool_config
from agentloop.settings import rollout_settings, reward_settings

SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
STRATEGY = "actor_rollout_ref.rollout.multi_turn.context.strategy"


@pytest.fixture(scope="module")
def scripted(scripted_model):
    return scripted_model


@pytest.fixture(scope="module")
def server(local_ray, scripted):
    server = RolloutServer.remote(rollout_settings(tool_config(scripted)).servers, 0)
    ray.get(server.__ray_ready__.remote(), timeout=120)
    yield server
    ray.kill(server)


@pytest.fixture(scope="module")
def tokenizer(scripted):
    return AutoTokenizer.from_pretrained(scripted[1])


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    for turn in range(turns):
        messages += [{"role": "assistant", "content": f"a{turn}"}, {"role": "tool", "content": f"t{turn}"}]
    return messages


def test_sliding_window_keeps_the_prompt_and_the_last_turns_with_their_observations():
    messages = conversation(4)
    assert sliding_window(messages, 2) == messages[:2] + messages[6:]
    assert sliding_window(messages, 4) == messages
    user_turns = messages[:2] + [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
        {"role": "user", "content": "v"},
    ]
    assert sliding_window(user_turns + [{"role": "assistant", "content": "b"}], 1) == messages[:2] + [
        {"role": "assistant", "content": "b"}
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"use_inference_chat_template": True, "context": {"strategy": "sliding_window"}}, "contradict each other"),
        ({"context": {"strategy": "sliding_window", "window_turns": 0}}, "keeps at least 1 turn"),
        ({"context": {"strategy": "slidingwindow"}}, "neither one of"),
        ({"context": {"strategy": "no_such_module.rewrite"}}, "cannot be imported"),
    ],
)
def test_bad_strategy_settings_name_the_key_and_the_fix(settings, message):
    with pytest.raises(ValueError, match=message):
        context_strategy(OmegaConf.create(settings))


def test_a_strategy_that_returns_no_message_list_names_itself():
    strategy = context_strategy(OmegaConf.create({"context": {"strategy": "tests.support.contexts.returns_text"}}))
    with pytest.raises(ValueError, match="'tests.support.contexts.returns_text' returned 'not a message list'"):
        strategy.messages(conversation(1))
    assert context_strategy(OmegaConf.create({"use_inference_chat_template": True})).name == "inference_template"


def teacher_forced(model, segment) -> torch.Tensor:
    ids = torch.tensor([segment.prompt_ids + segment.response_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0].float(), -1)
    start = len(segment.prompt_ids)
    return log_probs[start - 1 : -1].gather(-1, torch.tensor(segment.response_ids)[:, None])[:, 0]


def re_encodes(tokenizer, segment) -> bool:
    """Whether each run of sampled tokens in ``segment`` is what its own text encodes to (at temperature 1 a tiny model
    may sample another split of the same text, which a re-rendered conversation cannot reproduce)."""
    runs, run = [], []
    for token, sampled in zip(segment.response_ids, segment.response_mask):
        if sampled:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return all(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids for ids in runs + [run] if ids)


@pytest.mark.parametrize(
    "strategy", ["append", "inference_template", "sliding_window", "tests.support.contexts.last_message_only"]
)
def test_every_segment_scores_as_sampled_under_its_exact_context(server, tokenizer, scripted, strategy):
    output = run_loop(
        server,
        tokenizer,
        scripted,
        "loop",
        f"{STRATEGY}={strategy}",
        "actor_rollout_ref.rollout.multi_turn.context.window_turns=1",
        sampling=SAMPLED,
    )
    model = AutoModelForCausalLM.from_pretrained(scripted[1], dtype=torch.float32)
    segments = output.all_segments()
    for segment in segments:
        mask = torch.tensor(segment.response_mask).bool()
        rollout = torch.tensor(segment.response_logprobs)
        assert torch.allclose(rollout[mask], teacher_forced(model, segment)[mask], atol=1e-4)
        assert torch.all(rollout[~mask] == 0)
    assert [segment.rewritten_by for segment in segments] == [None] + [strategy] * (len(segments) - 1)
    if strategy == "append" or (
        strategy == "inference_template" and all(re_encodes(tokenizer, segment) for segment in segments)
    ):  # our template re-renders the conversation as it was appended
        assert len(segments) == 1
    elif (
        strategy == "inference_template"
    ):  # a sampled reply whose text encodes to other ids: the re-render differs there
        for before, after in zip(segments, segments[1:]):
            so_far = before.prompt_ids + before.response_ids
            assert after.prompt_ids[: len(so_far)] != so_far
    else:  # the model turn whose context is the first rewrite: sampled at temperature 1, an episode may end sooner
        first_rewritten = {"sliding_window": 3, "tests.support.contexts.last_message_only": 2}[strategy]
        assert len(segments) >= 2 if len(output.turns) >= first_rewritten else len(segments) == 1, len(output.turns)


def test_append_is_todays_trajectory_and_a_window_starts_segments_that_drop_old_turns(server, tokenizer, scripted):
    default = run_loop(server, tokenizer, scripted, "loop")
    append = run_loop(server, tokenizer, scripted, "loop", f"{STRATEGY}=append")
    assert (append.prompt_ids, append.response_ids, append.response_mask, append.response_logprobs) == (
        default.prompt_ids,
        default.response_ids,
        default.response_mask,
        default.response_logprobs,
    )
    assert not default.segments and default.end_reason == "stop"

    window = run_loop(
        server,
        tokenizer,
        scripted,
        "loop",
        f"{STRATEGY}=sliding_window",
        "actor_rollout_ref.rollout.multi_turn.context.window_turns=1",
    )
    segments = window.all_segments()
    assert len(segments) >= 2  # (without its earlier turns, the scripted model may call tools up to max_turns)
    assert segments[0].prompt_ids == default.prompt_ids
    prompt_text = tokenizer.decode(default.prompt_ids)
    for segment in segments[1:]:
        context = tokenizer.decode(segment.prompt_ids)
        assert context.startswith(prompt_text)  # the prompt is kept
        assert context.count("<tool_response>") == 1  # and one turn with its observation: the older ones are dropped
        assert segment.response_mask[0] == 1  # a new context starts with the model's turn
    # the first context grows by one turn before the window drops one; each later context holds one turn
    assert len(window.turns) == len(segments) + 1
    assert window.num_turns == 1 + len(window.turns) + len(window.observation_roles)
    assert sum(turn.model_tokens for turn in window.turns) == sum(sum(segment.response_mask) for segment in segments)
    # what its reward scores: every turn and observation once, in order, though no later context shows them all
    whole = tokenizer.decode(window.whole_response_ids())
    assert whole.count("<tool_response>") == len(window.observation_roles) == len(window.turns) - 1
    turns = [
        tokenizer.decode(segment.response_ids[start:end])
        for segment in segments
        for value, start, end in mask_runs(segment.response_mask)
        if value
    ]
    assert whole.startswith(turns[0]) and whole.endswith(turns[-1])
    position = 0
    for turn in turns:  # in order (index raises if one is missing past the one before)
        position = whole.index(turn, position) + len(turn)


def test_a_context_that_does_not_fit_ends_the_trajectory_on_a_model_token(server, tokenizer, scripted):
    output = run_loop(server, tokenizer, scripted, "loop", f"{STRATEGY}=tests.support.contexts.long_note")
    assert output.end_reason == "context_length"
    assert not output.segments and output.response_mask[-1] == 1  # the turn before the note is the last


def test_a_batch_has_a_row_per_segment_the_ranks_score_as_sampled(local_ray, scripted):
    """One row per segment through the manager, a failing user strategy failing its sample only, and the trainer's
    two ranks re-scoring every segment as the engine sampled it (rank 0 holds more rows than rank 1)."""
    config = tool_config(
        scripted,
        f"{STRATEGY}=tests.support.contexts.window_failing_on_loop",
        "actor_rollout_ref.rollout.max_failed_sample_ratio=0.5",
    )
    setup = manager_and_two_ranks(config)
    manager, actors = next(setup)
    try:
        rows = [script_row("multi", data_source="tools"), script_row("loop")]
        batch = manager.generate_sequences(rows, validate=True)
        sampled = manager.generate_sequences(rows).batch  # (greedy turns have no logprobs to compare)
        mask = sampled["response_mask"].bool()
        assert torch.allclose(scores(actors, sampled)[mask], sampled["rollout_log_probs"][mask], atol=1e-4)
    finally:
        next(setup, None)
    fields, tensors = batch.non_tensor_batch, batch.batch
    rows = len(batch)
    assert rows >= 3 and batch.num_trajectories == 2  # "multi" submits in its second turn: a new context follows
    assert tensors["segment_index"].tolist() == list(range(rows - 1)) + [0]
    assert fields["rewritten_by"].tolist() == [None] + [fields["rewritten_by"][1]] * (rows - 2) + [None]
    assert fields["rewritten_by"][1] == "tests.support.contexts.window_failing_on_loop"
    assert len(set(fields["uid"][: rows - 1])) == 1 and fields["uid"][0] != fields["uid"][-1]  # repeated per row
    # the reward sits on the trajectory's last row only; every row's context is its own
    assert (
        tensors["rm_scores"][: rows - 2].sum() == 0
        and tensors["rm_scores"][rows - 2].sum() == fields["reward_score"][0]
    )
    assert tensors["prompts"].shape[1] >= 768 and all(
        tensors["response_mask"][row].sum() > 0 for row in range(rows - 1)
    )
    assert fields["end_reason"][-1] == "failed" and all(failure is None for failure in fields["failure"][:-1])
    assert (
        "context strategy 'tests.support.contexts.window_failing_on_loop' raised RuntimeError: cannot rewrite"
        in fields["failure"][-1].error
    )
    assert (
        batch.meta_info["rollout/failed_samples"] == 1
        and batch.meta_info["rollout/segments_per_trajectory/max"] == rows - 1
    )


def test_policy_versions_run_through_the_segments_in_order():
    output = AgentLoopOutput(
        [1], [5, 6, 7], [1, 0, 1], [0.0] * 3, segments=[Segment([1], [2, 3, 4], [1, 1, 0], [0.0] * 3)]
    )
    output.set_policy_versions([3, 3, 4, 4])
    assert output.segments[0].policy_versions == [3, 3, -1] and output.policy_versions == [4, -1, 4]


def think_turn(tokenizer, text: str) -> TokenOutput:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return TokenOutput(ids, [-0.5] * len(ids), "stop")


@pytest.mark.skipif(not QWEN3_CONFIG.exists(), reason="../shared/fixtures/qwen3 is not present")
def test_qwen3s_template_drops_earlier_reasoning_and_that_starts_a_segment(model_path, tmp_path):
    """With Qwen3's real template, ``inference_template`` renders what production renders: a tool result extends the
    context (reasoning in the current tool chain is kept), a new user message drops the earlier turns' reasoning,
    so the next context is a new segment; ``append`` keeps the exact tokens in one segment."""
    tokenizer = AutoTokenizer.from_pretrained(with_qwen3_template(model_path, tmp_path / "qwen3"))
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]

    def rolled_out(strategy: str) -> Trajectory:
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
        trajectory = Trajectory(
            tokenizer,
            prompt,
            list(ids),
            None,
            context=ContextStrategy(strategy, (lambda m: m) if strategy != "append" else None),
        )
        generation_prompt_thinks = tokenizer.decode(ids).endswith("<think>\n")
        opening = "" if generation_prompt_thinks else "<think>\n"
        trajectory.add_model_turn(think_turn(tokenizer, opening + "Add them.\n</think>\n\nI will check with the tool."))
        trajectory.add_observation_within([{"role": "tool", "content": "5"}], 512)
        trajectory.add_model_turn(think_turn(tokenizer, opening + "It says 5.\n</think>\n\nThe answer is 5."))
        trajectory.add_observation_within([{"role": "user", "content": "And 2 + 4?"}], 512)
        return trajectory

    rendered = rolled_out("inference_template")
    output = rendered.to_output()
    segments = output.all_segments()
    assert len(segments) == 2 and segments[1].rewritten_by == "inference_template"
    expected = tokenizer.apply_chat_template(
        rendered.messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert segments[1].prompt_ids == list(expected)
    context = tokenizer.decode(segments[1].prompt_ids)
    assert "Add them." not in context and "It says 5." not in context and "The answer is 5." in context
    assert "Add them." in tokenizer.decode(segments[0].response_ids)  # the first segment keeps the sampled reasoning
    assert [value for value, _, _ in mask_runs(segments[0].response_mask)] == [1, 0, 1]  # turn, tool result, turn

    appended = rolled_out("append").to_output()
    assert not appended.segments
    assert appended.response_ids[: len(segments[0].response_ids)] == segments[0].response_ids


ECHO_REWARD = """def echo(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.0, "solution_str": solution_str}
"""


def solution_str(tokenizer, output: AgentLoopOutput, tmp_path) -> str:
    """What a reward function is given as ``solution_str`` for ``output``, through the worker's scoring."""
    (tmp_path / "echo_reward.py").write_text(ECHO_REWARD)
    config = small_config(
        f"custom_reward_function.path={tmp_path / 'echo_reward.py'}",
        "custom_reward_function.name=echo",
        "data.max_response_length=512",
    )
    score = asyncio.run(score_output(reward_settings(config), tokenizer, {"data_source": "any"}, output))
    return score.reward_extra_info["solution_str"]


# two answered questions: each turn answered by a tool result, then the user asks again
QWEN3_STEPS = [
    ("Add them.\n</think>\n\nI will check with the tool.", {"role": "tool", "content": "5"}),
    ("It says 5.\n</think>\n\nThe answer is 5.", {"role": "user", "content": "And 2 + 4?"}),
    ("Add again.\n</think>\n\nI will check.", {"role": "tool", "content": "6"}),
    ("It says 6.\n</think>\n\nThe answer is 6.", None),
]


@pytest.mark.skipif(not QWEN3_CONFIG.exists(), reason="../shared/fixtures/qwen3 is not present")
@pytest.mark.parametrize("strategy", ["inference_template", "sliding_window"])
def test_a_reward_function_is_given_every_turn_and_observation_of_a_rewritten_trajectory(
    model_path, tmp_path, strategy
):
    """With Qwen3's real template, whatever contexts the strategy made, a reward function's ``solution_str`` is what
    verl's reward manager decodes for the same conversation unrewritten: the ``append`` trajectory's response,
    ``skip_special_tokens=True``; the first turn and its tool result included, not the last segment alone."""
    tokenizer = AutoTokenizer.from_pretrained(with_qwen3_template(model_path, tmp_path / "qwen3"))
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    rewrites = {"inference_template": lambda m: m, "sliding_window": functools.partial(sliding_window, window_turns=1)}

    def rolled_out(context: ContextStrategy) -> AgentLoopOutput:
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
        trajectory = Trajectory(tokenizer, prompt, list(ids), None, context=context)
        opening = "" if tokenizer.decode(ids).endswith("<think>\n") else "<think>\n"
        for turn, observation in QWEN3_STEPS:
            trajectory.add_model_turn(think_turn(tokenizer, opening + turn))
            if observation is not None:
                assert trajectory.add_observation_within([observation], 1024) is not None
        return trajectory.to_output()

    rewritten = rolled_out(ContextStrategy(strategy, rewrites[strategy]))
    appended = rolled_out(ContextStrategy("append"))
    assert len(rewritten.all_segments()) >= 2 and not appended.segments
    solution = solution_str(tokenizer, rewritten, tmp_path)
    assert solution == tokenizer.decode(appended.response_ids, skip_special_tokens=True)
    assert solution.index("I will check with the tool.") < solution.index("5") < solution.index("And 2 + 4?")
    assert solution.endswith("The answer is 6.")


def test_a_client_that_rewrites_its_history_closes_the_segment_with_the_messages_after_its_last_reply(model_path):
    """``start_segment`` (a gateway client that edited its history): the whole response is the conversation appended,
    the new context's messages after the reply it shows standing for the observation."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def render(messages: list[dict[str, str]]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))

    def reply(text: str) -> TokenOutput:
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return TokenOutput(ids, [-0.5] * len(ids), "stop")

    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]
    edited = [
        {"role": "system", "content": "Be briefer."},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "and then?"},
    ]
    client, appended = (Trajectory(tokenizer, prompt, render(prompt), None) for _ in range(2))
    for trajectory in (client, appended):
        trajectory.add_model_turn(reply("a0"))
        trajectory.add_observation_within([{"role": "tool", "content": "t0"}], 512)
        trajectory.add_model_turn(reply("a1"))
    client.start_segment(render(edited), edited, "client", None)
    appended.add_observation_within(edited[-1:], 512)
    for trajectory in (client, appended):
        trajectory.add_model_turn(reply("a2"))
    output = client.to_output()
    assert len(output.all_segments()) == 2
    assert output.whole_response_ids() == appended.to_output().response_ids


def test_a_window_segment_shows_exactly_the_images_of_the_messages_it_keeps(vlm_path):
    processor = load_processor(vlm_path)
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    messages, images = split_images([{"role": "user", "content": "<image>Which?"}], [picture("red")], "row 0")
    processed = process_images(processor, images, "row 0")
    prompt = expand_image_pads(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False), processed, pad, "row 0"
    )
    window = ContextStrategy("sliding_window", functools.partial(sliding_window, window_turns=1))
    trajectory = Trajectory(tokenizer, messages, prompt, None, processor=processor, images=processed, context=window)
    sizes = [(84, 112), (56, 56), (112, 56)]
    for turn, size in enumerate(sizes):
        reply = tokenizer.encode(f"it is red {turn}") + [tokenizer.eos_token_id]
        trajectory.add_model_turn(TokenOutput(reply, [-0.5] * len(reply), "stop"))
        assert trajectory.add_observation_within([picture_message("blue", *size)], 512) is not None
    reply = tokenizer.encode("done") + [tokenizer.eos_token_id]
    trajectory.add_model_turn(TokenOutput(reply, [-0.5] * len(reply), "stop"))

    segments = trajectory.to_output().all_segments()
    # the first context grows by a turn and its picture; each later one shows the prompt's picture and its turn's
    prompt_grid = list(processed[0].grid_thw)
    expected = [[prompt_grid, list(process_images(processor, [picture("blue", *sizes[0])], "")[0].grid_thw)]]
    expected += [
        [prompt_grid, list(process_images(processor, [picture("blue", *size)], "")[0].grid_thw)] for size in sizes[1:]
    ]
    assert [segment.multi_modal_inputs["image_grid_thw"].tolist() for segment in segments] == expected
    for segment in segments:
        grids = segment.multi_modal_inputs["image_grid_thw"]
        assert (segment.prompt_ids + segment.response_ids).count(pad) == int(grids.prod(-1).sum()) // 4
        assert len(segment.multi_modal_inputs["pixel_values"]) == int(grids.prod(-1).sum())
