"""The built-in visual task (``agentloop.tasks.colours``, ``config/vlm_grpo.yaml``): its config composes, its
data is deterministic with the answer only in the pixels, its prompts and observations fit the configured
lengths with their images expanded, its answers are judged right, and its environment shows pictures."""

from __future__ import annotations

import io
import random

import numpy
import pytest
from omegaconf import OmegaConf
from PIL import Image

from agentloop.images import expand_image_pads, process_images, split_images
from agentloop.models.loading import load_processor
from agentloop.tasks.colours.data import FOLLOW_UP, episode, make_rows
from agentloop.tasks.colours.env import ColoursEnv
from agentloop.tasks.colours.reward import COLOURS, INITIALS, answer_colour, score_answer
from agentloop.tasks.colours.warm_start import conversation

CHANNEL = {"red": 0, "green": 1, "blue": 2}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from agentloop.config import compose_config
    from agentloop.preparation import prepare

    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENTLOOP_CACHE", str(cache))
        config = compose_config(config_name="vlm_grpo")
        # the data (cheap) inside the patched cache; the warm start is left out (it would train)
        prepare(config, only=["train_data", "val_data"])
        files = [str(config.data.train_files[0]), str(config.data.val_files[0])]
    return config, files


def dominant(image: Image.Image) -> str:
    """The colour whose channel leads in the picture's median pixel: what a reader of the pixels answers."""
    median = numpy.median(numpy.asarray(image).reshape(-1, 3), axis=0)
    return max(CHANNEL, key=lambda colour: median[CHANNEL[colour]])


def test_config_composes_with_the_task_data_and_warm_start(config):
    config, files = config
    raw = OmegaConf.to_container(config.actor_rollout_ref.model, resolve=False)
    assert raw["path"] == "${task.prepare.warm_start.path}"
    assert config.task.prepare.warm_start._target_ == "agentloop.tasks.colours.warm_start.warm_start_path"
    assert config.algorithm.adv_estimator == "grpo" and config.actor_rollout_ref.rollout.n == 8
    assert config.actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode == "disable"
    from trainer.data import read_rows

    train, test = (read_rows(path) for path in files)
    assert (len(train), len(test)) == (512, 64)
    assert {row["agent_name"] for row in train} == {"env_agent"}


def test_rows_are_deterministic_and_the_answer_is_in_the_pixels(config):
    _, files = config
    from trainer.data import read_rows

    assert make_rows(16, split="train") == make_rows(16, split="train")
    assert make_rows(4, split="train") != make_rows(4, split="test")
    rows = read_rows(files[0])  # through parquet, as the trainer reads them
    colours = []
    for row in rows:
        truth = row["reward_model"]["ground_truth"].split()
        (image,) = row["images"]
        picture = Image.open(io.BytesIO(image["bytes"])).convert("RGB")
        assert dominant(picture) == truth[0]
        assert row["prompt"][1]["content"].startswith("<image>") and not any(
            c in row["prompt"][1]["content"] for c in COLOURS
        )
        # the environment redraws the same episode: the row's picture is its first, and the text names no answer
        pictures = episode(row["extra_info"]["env_kwargs"]["episode"], len(truth))
        assert [colour for colour, _ in pictures] == truth
        assert pictures[0][1].tobytes() == picture.tobytes()
        assert all(dominant(image) == colour for colour, image in pictures)
        colours += truth
    assert {c: colours.count(c) / len(colours) for c in COLOURS} == pytest.approx({c: 1 / 3 for c in COLOURS}, abs=0.05)


def test_prompts_and_observations_fit_the_configured_lengths_with_images_expanded(config, vlm_path):
    config, files = config
    from trainer.data import read_rows

    processor = load_processor(vlm_path)
    tokenizer, pad = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def expanded(messages, images, **kwargs) -> list[int]:
        messages, found = split_images(messages, images, "test")
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        return expand_image_pads(ids, process_images(processor, found, "test"), pad, "test")

    for path in files:
        for row in read_rows(path):
            prompt = expanded(row["prompt"], row["images"], add_generation_prompt=True)
            assert len(prompt) <= config.data.max_prompt_length
            # answers far longer than the initials asked for, with the observation between them: the response fits
            chat = conversation(row, random.Random(0))
            chat = [{**m, "content": "green"} if m["role"] == "assistant" else m for m in chat]
            whole = expanded(chat, None)
            assert len(whole) - len(prompt) <= config.data.max_response_length


def test_answers_are_judged_by_their_first_word():
    assert score_answer("R", "red") == 1.0
    assert score_answer(" b.", "blue") == 1.0
    assert score_answer("green", "green") == 1.0  # the name counts as well as the initial
    assert score_answer("G", "red") == 0.0
    assert score_answer("R G B", "blue") == 0.0  # naming every colour earns nothing
    assert score_answer("The answer is R", "red") == 0.0
    assert answer_colour("") is None and answer_colour("purple") is None and answer_colour("RG") is None


def test_the_environment_judges_each_turn_and_shows_the_next_picture():
    (row,) = make_rows(1, split="test")
    truth = row["reward_model"]["ground_truth"].split()
    env = ColoursEnv(**{k: v for k, v in row["extra_info"]["env_kwargs"].items() if k != "class_name"})
    env.reset()
    wrong = next(c for c in COLOURS if c != truth[0])
    observation, done, info = env.step(wrong)
    assert (done, info["reward"]) == (False, 0.0)
    message = env.format_observation(observation)
    messages, images = split_images([message], None, "observation")
    assert message["role"] == "user" and messages[0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": FOLLOW_UP},
    ]
    assert len(images) == 1 and dominant(images[0]) == truth[1]
    _, done, info = env.step(truth[1])
    assert (done, info["reward"]) == (True, 0.5)
    # a retry replays from reset: the same pictures again
    env.reset()
    assert env.step(truth[0])[2]["reward"] == 0.5


def test_the_warm_start_trains_only_the_answer_words(vlm_path):
    from agentloop.models.sft import _encode_chat

    (row,) = make_rows(1, split="warm_start")
    chat = conversation(row, random.Random(0))
    answers = [m["content"] for m in chat if m["role"] == "assistant"]
    assert len(answers) == 2 and set(answers) <= set(INITIALS)
    processor = load_processor(vlm_path)
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids, mask, images = _encode_chat(
        processor,
        chat,
        pad,
        tokenizer.encode("<|im_start|>assistant\n"),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "test",
    )
    assert len(images) == 2 and ids.count(pad) == sum(image.num_tokens for image in images)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "".join(f"{answer}<|im_end|>" for answer in answers)
