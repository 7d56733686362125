"""Images from the dataset row to the FSDP update, on the real tiny VLM: exact tokens, masks and logprobs."""

from __future__ import annotations

import asyncio
import io

import pytest
import ray
import torch
from transformers import AutoTokenizer

import agentloop.testing  # noqa: F401  (registers picture_turns)
from agentloop.agent_loop.single_turn import SingleTurnAgentLoop
from agentloop.agent_loop.trajectory import Trajectory
from agentloop.agent_loop.base import DictConfigWrap
from agentloop.images import expand_image_pads, process_images, split_images
from agentloop.models.loading import load_processor
from agentloop.protocol import TokenOutput
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolCall
from agentloop.tools.toolset import ToolSet
from tests.support.config import small_config
from tests.support.ranks import manager_and_two_ranks, scores
from tests.support.vision import CAMERA_SCHEMA, CameraTool, picture, picture_message

# three turns of six tokens; the first two answered by an 84x112 picture, then a 56x56 one
PICTURES = {"extra_info": {"turns": 3, "length": 6, "sizes": [[84, 112], [56, 56]]}, "agent_name": "picture_turns"}


def rows(tmp_path):
    path = tmp_path / "blue.png"
    picture("blue", 112, 56).save(path)
    png = io.BytesIO()
    picture("green").save(png, format="PNG")
    return [
        # verl's form: <image> in the text, the image in the row's `images` column (here a file path)
        {"prompt": [{"role": "user", "content": "<image>What colour?"}], "images": [str(path)], **PICTURES},
        # content parts carrying the image itself (bytes), two images in one prompt
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": png.getvalue()},
                        {"type": "image", "image": picture("red")},
                        {"type": "text", "text": "Same?"},
                    ],
                }
            ],
            **PICTURES,
        },
        {"prompt": [{"role": "user", "content": "no picture here"}], "agent_name": "single_turn_agent"},
        {
            "prompt": [{"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}]}],
            "images": [picture("red", 56, 84)],
            **PICTURES,
        },
    ]


@pytest.fixture(scope="module")
def setup(local_ray, vlm_path):
    config = small_config(
        f"actor_rollout_ref.model.path={vlm_path}",
        "data.max_prompt_length=64",
        "data.max_response_length=96",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.max_failed_sample_ratio=1.0",  # the bad-input test fails five of six samples on purpose
    )
    yield from manager_and_two_ranks(config)


def test_image_trajectories_are_exact_and_train_on_two_ranks(setup, vlm_path, tmp_path):
    manager, actors = setup
    output = manager.generate_sequences(rows(tmp_path))
    batch = output.batch
    assert all(failure is None for failure in output.non_tensor_batch["failure"])
    assert batch["position_ids"].shape == (4, 4, 64 + 96)  # M-RoPE: [B, 4, P+R]
    pad = AutoTokenizer.from_pretrained(vlm_path).convert_tokens_to_ids("<|image_pad|>")
    grids = batch["image_grid_thw"]
    images_per_row = (grids.prod(-1) > 0).sum(-1).tolist()
    assert images_per_row == [3, 4, 0, 3]  # the prompt's images and two observations' (one each)
    for row in range(4):
        # every image's pads, expanded to its grid (merged 2x2), and its patches: nothing more, nothing lost
        assert int((batch["input_ids"][row] == pad).sum()) == int(grids[row].prod(-1).sum()) // 4
        assert int((batch["pixel_values"][row].abs().sum(-1) > 0).sum()) == int(grids[row].prod(-1).sum())
        # observations (text and image pads) are masked out, model tokens are in
        response = batch["responses"][row]
        assert not batch["response_mask"][row][response == pad].any()
    assert grids[0, :3].tolist() == [
        [1, 4, 8],
        [1, 8, 6],
        [1, 4, 4],
    ]  # (t, h, w) in patches: 112x56 prompt, then 84x112, 56x56

    # the trainer's re-scoring on two ranks equals the engine's: rank 1 gets the text-only row in one of its
    # micro-batches while rank 0 scores images, so the ranks also stay in step through the vision tower
    mask = batch["response_mask"].bool()
    old = scores(actors, batch)
    assert torch.allclose(old[mask], batch["rollout_log_probs"][mask], atol=1e-4)

    train = batch.clone()
    train["old_log_probs"] = old
    train["advantages"] = torch.where(torch.arange(4)[:, None] % 2 == 0, 1.0, -1.0) * mask
    metrics = ray.get([actor.update_policy.remote(half) for actor, half in zip(actors, train.split(2))], timeout=120)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    state, _ = ray.get([actor.full_state_dict.remote() for actor in actors], timeout=120)
    assert any(name.startswith("model.visual.") for name in state)
    manager.update_weights(state)
    fresh = manager.generate_sequences(rows(tmp_path)).batch
    fresh_mask = fresh["response_mask"].bool()
    assert torch.allclose(scores(actors, fresh)[fresh_mask], fresh["rollout_log_probs"][fresh_mask], atol=1e-4)


def test_bad_images_fail_their_own_row_only(setup, tmp_path):
    manager, _ = setup
    too_many = [{"type": "image", "image": picture("red", 112, 112)}] * 4  # 4 x 16 pads > prompt_length 64
    bad = [
        {"prompt": [{"role": "user", "content": "<image>"}], "images": [str(tmp_path / "missing.png")]},
        {"prompt": [{"role": "user", "content": "<image> and <image>"}], "images": [picture("red")]},
        {"prompt": [{"role": "user", "content": "<image>"}], "images": [picture("red"), picture("blue")]},
        {"prompt": [{"role": "user", "content": too_many}]},
        {"prompt": [{"role": "user", "content": "<image>"}], "images": [b"not an image"]},
    ]
    good = {"prompt": [{"role": "user", "content": "<image>"}], "images": [picture("green")]}
    output = manager.generate_sequences([*({**row, "extra_info": {"index": i}} for i, row in enumerate(bad)), good])
    errors = [failure.error if failure is not None else "" for failure in output.non_tensor_batch["failure"]]
    assert "no image file" in errors[0] and "row 0" in errors[0]
    assert "more image placeholders than the 1 image(s)" in errors[1]
    assert "2 image(s) given but only 1 placeholder" in errors[2]
    assert "prompt_length=64" in errors[3] and "4 image(s)" in errors[3]
    assert "cannot read image" in errors[4] and "row 4" in errors[4]
    assert errors[5] == "" and output.batch["response_mask"][5].sum() > 0


def test_observation_deltas_with_images_equal_the_full_render(vlm_path, model_path):
    processor = load_processor(vlm_path)
    tokenizer = processor.tokenizer
    calls = []
    image_processor = processor.image_processor
    processor.image_processor = lambda *args, **kwargs: (
        calls.append(len(kwargs["images"])) or image_processor(*args, **kwargs)
    )
    processor.image_processor.merge_size = image_processor.merge_size
    messages, images = split_images([{"role": "user", "content": "<image>Which?"}], [picture("red")], "row 0")
    processed = process_images(processor, images, "row 0")
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompt = expand_image_pads(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False), processed, pad, "row 0"
    )
    trajectory = Trajectory(tokenizer, messages, prompt, None, processor=processor, images=processed)
    for turn in range(4):
        reply = tokenizer.encode(f"it is red {turn}") + [tokenizer.eos_token_id]
        trajectory.add_model_turn(TokenOutput(reply, [-0.5] * len(reply), "stop"))
        two = [
            picture_message("blue", 84, 112),
            {"role": "user", "content": [{"type": "image", "image": picture("green", 112, 56)}]},
        ]
        if turn < 3:
            trajectory.add_observation(trajectory.observation(two[: 1 + turn % 2]))
    assert trajectory.sanity_check("strict") == 0
    assert calls == [1, 1, 2, 1]  # one processor call per turn that brings images, over only its new images
    inputs = trajectory.to_output().multi_modal_inputs
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 6], [1, 8, 6], [1, 4, 8], [1, 8, 6]]
    assert trajectory.prompt_ids.count(pad) == 4 and len(inputs["pixel_values"]) == 16 + 48 + 48 + 32 + 48

    # a tool's image reaches the model in its tool message, processed once like any observation's
    tools = ToolSet([CameraTool({}, OpenAIFunctionToolSchema.from_written(CAMERA_SCHEMA))])
    result = asyncio.run(tools.call(ToolCall(name="camera", arguments={"colour": "green"}), "trajectory", {}, {}))
    trajectory.add_model_turn(TokenOutput([tokenizer.eos_token_id], [-0.5], "stop"))
    observation = trajectory.observation([{"role": "tool", "content": result.content(result.text)}])
    assert observation.ids.count(pad) == 6 and len(observation.images) == 1 and calls[-1] == 1
    assert "<tool_response>\n<|vision_start|><|image_pad|>" in tokenizer.decode(observation.ids)

    # a row with an image for a text-only model is refused by name
    config = small_config(f"actor_rollout_ref.model.path={model_path}")
    loop = SingleTurnAgentLoop(DictConfigWrap(config), None, AutoTokenizer.from_pretrained(model_path), None)
    with pytest.raises(ValueError, match="row 7 .*the model is text-only"):
        loop.start_trajectory(
            {"prompt": [{"role": "user", "content": "<image>"}], "images": [picture("red")], "index": 7}
        )
