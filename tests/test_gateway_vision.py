"""Images through the session gateway on the tiny vision-language model, in each API's own image shape (Chat
Completions ``image_url``, Anthropic ``image`` blocks, Responses ``input_image``): the first call's image, one a
later call adds (an observation), and a rewritten history (a new segment showing its images) are recorded with their
pads widened, and every model token's rollout logprob is the model's given exactly the images its segment shows."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import anthropic
import pytest
import ray
import torch
from openai import AsyncOpenAI, BadRequestError
from PIL import Image
from transformers import AutoModelForImageTextToText

from agentloop.agent_loop.external_agent import ExternalAgentLoop
from agentloop.models.loading import load_processor, vision_token_ids
from agentloop.gateway import Gateway
from agentloop.router import Router
from agentloop.server.rollout_server import RolloutServer
from agentloop.settings import rollout_settings
from tests.support.config import small_config

SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}


def png(colour: str, size: tuple[int, int]) -> str:
    data = io.BytesIO()
    Image.new("RGB", size, colour).save(data, format="PNG")
    return base64.b64encode(data.getvalue()).decode()


# 4 and 12 image tokens with the tiny model's processor (28x28 pixels per token)
RED, BLUE = png("red", (56, 56)), png("blue", (112, 84))


def anthropic_user(image: str, text: str) -> dict[str, Any]:
    source = {"type": "base64", "media_type": "image/png", "data": image}
    return {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": text}]}


async def anthropic_vision(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    first = [anthropic_user(RED, "what colour?")]
    reply = await client.messages.create(model="m", max_tokens=5, messages=first)
    history = [*first, {"role": "assistant", "content": reply.content}, anthropic_user(BLUE, "and this?")]
    await client.messages.create(model="m", max_tokens=5, messages=history)
    await client.messages.create(model="m", max_tokens=5, messages=[anthropic_user(BLUE, "again?")])
    return 1.0


def responses_user(image: str, text: str) -> dict[str, Any]:
    parts = [
        {"type": "input_image", "image_url": f"data:image/png;base64,{image}"},
        {"type": "input_text", "text": text},
    ]
    return {"role": "user", "content": parts}


async def responses_vision(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = [responses_user(RED, "what colour?")]
    reply = await client.responses.create(model="m", max_output_tokens=5, input=first)
    sent_back = [item.model_dump(exclude_none=True) for item in reply.output]
    await client.responses.create(
        model="m", max_output_tokens=5, input=[*first, *sent_back, responses_user(BLUE, "and this?")]
    )
    await client.responses.create(model="m", max_output_tokens=5, input=[responses_user(BLUE, "again?")])
    return 1.0


def chat_user(image: str, text: str) -> dict[str, Any]:
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": text},
    ]
    return {"role": "user", "content": parts}


async def chat_vision(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = [chat_user(RED, "what colour?")]
    reply = await client.chat.completions.create(model="m", max_tokens=5, messages=first)
    history = [*first, reply.choices[0].message.model_dump(exclude_none=True), chat_user(BLUE, "and this?")]
    await client.chat.completions.create(model="m", max_tokens=5, messages=history)
    await client.chat.completions.create(model="m", max_tokens=5, messages=[chat_user(BLUE, "again?")])
    local = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]}
    with pytest.raises(BadRequestError, match="must be a data: URI"):  # the worker reads no file for a client
        await client.chat.completions.create(model="m", max_tokens=5, messages=[local])
    return 1.0


@pytest.fixture(scope="module")
def config(vlm_path):
    return small_config(f"actor_rollout_ref.model.path={vlm_path}", "data.max_response_length=64")


@pytest.fixture(scope="module")
def server(local_ray, config):
    server = RolloutServer.remote(rollout_settings(config).servers, 0)
    ray.get(server.__ray_ready__.remote(), timeout=120)
    yield server
    ray.kill(server)


@pytest.fixture(scope="module")
def processor(vlm_path):
    return load_processor(vlm_path)


@pytest.fixture(scope="module")
def model(vlm_path):
    return AutoModelForImageTextToText.from_pretrained(vlm_path).eval()


def teacher_forced(model, segment) -> torch.Tensor:
    """Each response token's logprob given all before it and the segment's images, as the engine samples (vision
    tokens suppressed)."""
    ids = torch.tensor([segment.prompt_ids + segment.response_ids])
    pads = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=pads, **segment.multi_modal_inputs).logits[0].float()
    logits[:, vision_token_ids(model.config)] = -torch.inf
    tokens = torch.tensor(segment.response_ids)[:, None]
    return torch.log_softmax(logits, -1)[len(segment.prompt_ids) - 1 : -1].gather(-1, tokens)[:, 0]


@pytest.mark.parametrize("program", ["chat_vision", "anthropic_vision", "responses_vision"])
def test_images_in_each_api_are_recorded_with_the_segments_images(server, config, processor, model, program):
    async def run():
        router = Router([server])
        gateway = Gateway(router, processor.tokenizer, rollout_settings(config))
        loop = ExternalAgentLoop(
            server_manager=router,
            tokenizer=processor.tokenizer,
            processor=processor,
            config=config,
            function=f"{__name__}.{program}",
            gateway=gateway,
        )
        row = {"prompt": [{"role": "user", "content": "unused"}], "request_id": f"vision-{program}"}
        try:
            with Router.running_sample(row["request_id"]):
                return await loop.run(dict(SAMPLED), **row)
        finally:
            gateway.stop()

    output = asyncio.run(run())
    assert output.reward_score == 1.0 and output.metrics["gateway_calls"] == 3, (
        output.end_reason,
        output.metrics,
    )
    first, second = output.all_segments()
    assert second.rewritten_by == "client"
    pad = model.config.image_token_id
    # the first segment: the red picture's 4 pads in its prompt, the blue one's 12 in the observation (mask 0)
    assert first.prompt_ids.count(pad) == 4 and first.response_ids.count(pad) == 12
    assert [pad in first.response_ids[a:b] for a, b in ((0, 5), (5, len(first.response_ids) - 5))] == [False, True]
    assert first.multi_modal_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    assert second.prompt_ids.count(pad) == 12 and second.multi_modal_inputs["image_grid_thw"].tolist() == [[1, 6, 8]]
    for segment in (first, second):
        mask = torch.tensor(segment.response_mask).bool()
        rollout = torch.tensor(segment.response_logprobs)
        assert torch.allclose(rollout[mask], teacher_forced(model, segment)[mask], atol=1e-4)
        assert torch.all(rollout[~mask] == 0)
