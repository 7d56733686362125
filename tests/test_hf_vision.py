"""The hf engine's image lane on the tiny VLM, in-process: abort, a weight push mid-request, sleep and wake,
weights from disk, and a session's KV cache that never mixes two images."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForImageTextToText

from agentloop.images import expand_image_pads, image_inputs, process_images
from agentloop.models.loading import load_processor, vision_token_ids
from agentloop.server.hf_engine import HFEngine
from tests.support.vision import picture

LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def prompt(vlm_path):
    processor = load_processor(vlm_path)
    images = process_images(processor, [picture("red", 84, 84)], "test")
    pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    content = [{"type": "image"}, {"type": "text", "text": "what is it?"}]
    ids = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
    )
    return expand_image_pads(list(ids), images, pad, "test"), images, processor


def teacher_forced(model, prompt_ids, images, tokens) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + tokens])
    grid = image_inputs(images)["image_grid_thw"]
    mrope, _ = model.model.get_rope_index(ids, (ids == model.config.image_token_id).int(), grid)
    positions = torch.cat([torch.arange(ids.shape[1]).view(1, 1, -1), mrope])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, **image_inputs(images)).logits[0]
    logits[:, vision_token_ids(model.config)] = -1e9
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


async def started(engine, coroutine, tokens: int = 0):
    """A request running in the lane (with at least ``tokens`` sampled)."""
    task = asyncio.ensure_future(coroutine)
    while not engine._lane.in_flight:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02 * tokens)
    return task


def test_abort_weights_sleep_and_disk(vlm_path, prompt):
    prompt_ids, images, _ = prompt
    before = AutoModelForImageTextToText.from_pretrained(vlm_path)
    after = AutoModelForImageTextToText.from_pretrained(vlm_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in after.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))

    async def scenario():
        engine = HFEngine(vlm_path, device="cpu")
        try:
            task = await started(engine, engine.generate(prompt_ids, LONG, "aborted", images=images), tokens=5)
            assert await engine.abort("aborted") == 1
            aborted = await task
            assert aborted.finish_reason == "abort" and engine.num_in_flight == 0
            assert 0 < len(aborted.token_ids) == len(aborted.log_probs)  # the tokens it had, as text requests' aborts

            # new weights mid-request: the tokens so far come back `interrupted`, sampled by the old weights
            task = await started(engine, engine.generate(prompt_ids, LONG, "pushed", images=images), tokens=15)
            await engine.update_weights(dict(after.named_parameters()))
            cut = await task
            assert cut.finish_reason == "interrupted" and 0 < len(cut.token_ids) < LONG["max_new_tokens"]
            assert torch.allclose(
                torch.tensor(cut.log_probs), teacher_forced(before, prompt_ids, images, cut.token_ids), atol=1e-4
            )
            # continued under the new weights; no KV of the old weights is reused
            rest = await engine.generate(
                prompt_ids + cut.token_ids, {**LONG, "max_new_tokens": 8}, "pushed", images=images
            )
            assert rest.cached_tokens == 0
            full = cut.token_ids + rest.token_ids
            assert torch.allclose(
                torch.tensor(rest.log_probs),
                teacher_forced(after, prompt_ids, images, full)[len(cut.token_ids) :],
                atol=1e-4,
            )

            task = await started(engine, engine.generate(prompt_ids, LONG, "slept", images=images))
            await engine.sleep()
            assert (await task).finish_reason == "abort" and engine.is_sleeping
            with pytest.raises(RuntimeError, match="asleep"):
                await engine.generate(prompt_ids, LONG, "slept", images=images)
            await engine.wake_up()

            # the checkpoint on disk names its layers as saved (model.layers.*, visual.*): loaded through transformers
            await engine.update_weights_from_disk(vlm_path)
            again = await engine.generate(prompt_ids, {**LONG, "max_new_tokens": 8}, "disk", images=images)
            assert torch.allclose(
                torch.tensor(again.log_probs), teacher_forced(before, prompt_ids, images, again.token_ids), atol=1e-4
            )
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_session_reuses_its_cache_only_for_the_same_pixels(vlm_path, prompt):
    prompt_ids, images, processor = prompt
    model = AutoModelForImageTextToText.from_pretrained(vlm_path)
    [other] = process_images(processor, [picture("blue", 84, 84)], "test")  # same size, same pads: other pixels
    short = {**LONG, "max_new_tokens": 6}

    async def scenario():
        engine = HFEngine(vlm_path, device="cpu")
        try:
            first = await engine.generate(prompt_ids, short, "session", images=images)
            follow_up = prompt_ids + first.token_ids
            same = await engine.generate(follow_up, short, "session", images=images)
            swapped = await engine.generate(follow_up, short, "session", images=[other])
            return first, same, swapped
        finally:
            await engine.shutdown()

    first, same, swapped = asyncio.run(scenario())
    assert same.cached_tokens == len(prompt_ids) + len(first.token_ids) - 1  # all but the last sampled token
    assert swapped.cached_tokens == prompt_ids.index(model.config.image_token_id) - 1  # up to the vision block
    follow_up = prompt_ids + first.token_ids
    assert torch.allclose(
        torch.tensor(swapped.log_probs), teacher_forced(model, follow_up, [other], swapped.token_ids), atol=1e-4
    )
