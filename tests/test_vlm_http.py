"""Images over HTTP: the sglang backend's client with ``image_data`` (checked against SGLang's own schema and
driven against our hf server), and the server's SGLang ``/generate`` and OpenAI chat routes with images."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
import ray
import requests
import torch
from fastapi.testclient import TestClient
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from agentloop.images import ProcessedImage, expand_image_pads, image_inputs, process_images
from agentloop.models.loading import load_processor, vision_token_ids
from agentloop.server.http import build_app
from agentloop.server.rollout_server import RolloutServer
from agentloop.server.sglang_engine import SGLangEngine
from agentloop.server.sglang_requests import build_generate_request
from tests.support.config import small_config
from tests.support.sglang_contract import load_api_types
from agentloop.settings import rollout_settings

API_KEY = "k"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
# greedy logprobs are all 0 (the distribution sampled from is one-hot): sampled ones are checked by teacher forcing
SAMPLED = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
api_types = load_api_types()
needs_sglang = pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")


def square(colour: str, size: tuple[int, int]) -> Image.Image:
    return Image.new("RGB", size, colour)


# 4, 12 and 16 image tokens with the tiny model's processor (28x28 pixels per token)
PICTURES = [square("red", (56, 56)), square("blue", (112, 84)), square("green", (112, 112))]


def data_uri(image: Image.Image) -> str:
    png = io.BytesIO()
    image.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


@pytest.fixture(scope="module")
def processor(vlm_path):
    return load_processor(vlm_path)


@pytest.fixture(scope="module")
def pad_id(processor) -> int:
    return processor.tokenizer.convert_tokens_to_ids(processor.image_token)


@pytest.fixture(scope="module")
def model(vlm_path):
    return AutoModelForImageTextToText.from_pretrained(vlm_path).eval()


def teacher_forced(model, prompt: list[int], images: list[ProcessedImage], tokens: list[int]) -> torch.Tensor:
    """Each of ``tokens``' logprob after ``prompt`` (expanded pads) with ``images``, in one forward pass, under
    the distribution the engine samples from (vision tokens suppressed)."""
    ids = torch.tensor([prompt + tokens])
    pads = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=pads, **image_inputs(images)).logits[0].float()
    logits[:, vision_token_ids(model.config)] = -torch.inf
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def assert_logprobs_of(model, prompt, images, tokens, log_probs) -> None:
    """``log_probs`` are the model's with these images, and measurably not with other pixels of the same sizes."""
    assert tokens and len(tokens) == len(log_probs)
    assert torch.tensor(log_probs) == pytest.approx(teacher_forced(model, prompt, images, tokens), abs=1e-5)
    recoloured = [ProcessedImage(1 - image.pixel_values, image.grid_thw, image.num_tokens, "", b"") for image in images]
    assert (torch.tensor(log_probs) - teacher_forced(model, prompt, recoloured, tokens)).abs().max() > 1e-3


@pytest.fixture(scope="module")
def server(local_ray, vlm_path):
    """One rollout server with its HTTP front (what the manager starts per rank; no workers needed here)."""
    config = small_config(
        f"actor_rollout_ref.model.path={vlm_path}", f"actor_rollout_ref.rollout.http.api_key={API_KEY}"
    )
    server = RolloutServer.remote(rollout_settings(config).servers, 0)
    yield server
    ray.get(server.shutdown.remote(), timeout=60)
    ray.kill(server)


@pytest.fixture(scope="module")
def url(server) -> str:
    return ray.get(server.start_http.remote(), timeout=120)


@pytest.fixture(scope="module")
def client(vlm_path, url):
    return SGLangEngine(vlm_path, url=url, api_key=API_KEY, startup_timeout_s=60)


def call(client: SGLangEngine, request):
    """Run one client call on a fresh event loop, closing the loop's connection pool after it."""

    async def once():
        try:
            return await request
        finally:
            await client.shutdown()  # attached: closes the connections only

    return asyncio.run(once())


def one_pad_prompt(processor, pictures: list[Image.Image], text: str = "what colour?") -> list[int]:
    """The chat template's ids for one user turn with ``pictures``: one pad per image (SGLang's convention)."""
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
    return list(
        processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def direct(server, ids: list[int], images: list[ProcessedImage], rid: str, params=GREEDY):
    """The same request through ``RolloutServer.generate``, no HTTP in between."""
    return ray.get(server.generate.remote(ids, params, rid, images=images or None), timeout=60)


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, headers=AUTH, timeout=60)


@needs_sglang
def test_image_requests_validate_against_sglangs_schema(processor, pad_id):
    images = process_images(processor, PICTURES[:2], "test")
    one_pad = one_pad_prompt(processor, PICTURES[:2])
    expanded = expand_image_pads(one_pad, images, pad_id, "test")
    request = build_generate_request(expanded, GREEDY, "rid-1", images, image_pad_id=pad_id)
    decoded = api_types.GenerateRequest.from_json_value(request)
    # SGLang's convention: one pad per image, and the images in order as data URIs of the very PNGs
    assert list(decoded.input_ids) == one_pad and decoded.image_data == request["image_data"]
    assert [base64.b64decode(uri.split(",", 1)[1]) for uri in request["image_data"]] == [image.png for image in images]
    assert "image_data" not in build_generate_request(one_pad, GREEDY, "rid-2")
    with pytest.raises(ValueError, match="image pad token"):
        build_generate_request(one_pad, GREEDY, "rid-3", images, image_pad_id=pad_id)  # pads not expanded


def test_sglang_client_with_images_matches_the_engine(server, client, model, processor, pad_id):
    images = process_images(processor, PICTURES, "test")
    prompt = expand_image_pads(one_pad_prompt(processor, PICTURES), images, pad_id, "test")
    through_http = call(client, client.generate(prompt, GREEDY, "vlm-client", images=images))
    reference = direct(server, prompt, images, "vlm-direct")
    assert through_http.token_ids == reference.token_ids and len(reference.token_ids) == GREEDY["max_new_tokens"]
    assert through_http.log_probs == pytest.approx(reference.log_probs, abs=1e-5)
    sampled = call(client, client.generate(prompt, SAMPLED, "vlm-sampled", images=images))
    assert_logprobs_of(model, prompt, images, sampled.token_ids, sampled.log_probs)
    assert client.num_in_flight == 0


def test_sglang_client_fails_when_the_server_counts_other_image_tokens(client, pad_id):
    # The trajectory's processor caps images at 56x56 pixels (4 tokens), the server's at 112x112 (16): the
    # server's prompt is 12 tokens longer than the trajectory's, and its tokens belong to other ids.
    capped = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )

    [image] = process_images(SimpleNamespace(image_processor=capped), [PICTURES[2]], "test")
    assert image.num_tokens == 4
    prompt = [1, 294, pad_id, pad_id, pad_id, pad_id, 207]
    with pytest.raises(
        RuntimeError, match=r"SGLang counted 19 prompt tokens, but the trajectory's prompt has 7.*min_pixels/max_pixels"
    ):
        call(client, client.generate(prompt, GREEDY, "vlm-mismatch", images=[image]))
    assert client.num_in_flight == 0


@needs_sglang
def test_generate_route_takes_image_data_in_every_form(url, model, processor, pad_id, tmp_path):
    images = process_images(processor, PICTURES, "test")
    one_pad = one_pad_prompt(processor, PICTURES)
    expanded = expand_image_pads(one_pad, images, pad_id, "test")
    PICTURES[2].save(tmp_path / "green.png")
    image_data = [data_uri(PICTURES[0]), data_uri(PICTURES[1]).split(",", 1)[1], str(tmp_path / "green.png")]
    request = {
        "input_ids": one_pad,
        "image_data": image_data,
        "sampling_params": SAMPLED,
        "return_logprob": True,
        "rid": "native",
    }
    api_types.GenerateRequest.from_json_value(request)
    response = post(url, "/generate", request)
    assert response.status_code == 200, response.text
    body = response.json()
    api_types.GenerateResponse.from_json_value(body)
    assert body["meta_info"]["prompt_tokens"] == len(expanded) == len(one_pad) - 3 + 4 + 12 + 16
    assert_logprobs_of(
        model, expanded, images, body["output_ids"], [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
    )


def test_generate_route_refuses_bad_images(url, processor):
    one_pad = one_pad_prompt(processor, PICTURES[:1])
    cases = {
        "cannot read image": [data_uri(PICTURES[0]).split(",")[0] + ",AAAA"],  # valid base64, not an image
        "1 image pad(s) in the rendered text for 2 image(s)": [data_uri(PICTURES[0]), data_uri(PICTURES[1])],
        "neither a data URI, base64 nor a file": ["/no/such/image.png"],
        "does not fetch URLs": ["https://example.com/cat.png"],
        "only {'url': ...} is supported": [{"url": data_uri(PICTURES[0]), "max_pixels": 4}],
    }
    for message, image_data in cases.items():
        response = post(url, "/generate", {"input_ids": one_pad, "image_data": image_data, "sampling_params": GREEDY})
        assert response.status_code == 400 and message in response.json()["error"]["message"], (message, response.text)
    no_images = post(url, "/generate", {"input_ids": one_pad, "sampling_params": GREEDY})
    assert no_images.status_code == 400 and "1 image pad(s) in the rendered text for 0 image(s)" in no_images.text


def test_chat_route_with_an_image_url(url, model, processor, pad_id):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri(PICTURES[1])}},
                {"type": "text", "text": "what colour? <image> is literal text here"},
            ],
        }
    ]
    response = post(url, "/v1/chat/completions", {"messages": messages, "temperature": 1.0, "max_tokens": 6})
    assert response.status_code == 200, response.text
    body = response.json()
    [image] = process_images(processor, PICTURES[1:2], "test")
    prompt = expand_image_pads(
        one_pad_prompt(processor, PICTURES[1:2], "what colour? <image> is literal text here"), [image], pad_id, "test"
    )
    assert (
        body["prompt_token_ids"] == prompt
        and body["usage"]["prompt_tokens"] == len(prompt)
        and prompt.count(pad_id) == 12
    )
    [choice] = body["choices"]
    assert_logprobs_of(
        model, prompt, [image], choice["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]
    )

    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    response = post(url, "/v1/chat/completions", {"messages": broken, "max_tokens": 2})
    assert (
        response.status_code == 400 and "messages[0], image 0: cannot read image" in response.json()["error"]["message"]
    )


def test_images_for_a_text_only_model_are_refused(model_path):
    # the app over a text-only checkpoint: images are refused before any engine is asked
    app = build_app(
        None, AutoTokenizer.from_pretrained(model_path), model_name=model_path, tool_format="hermes", api_key=None
    )
    with TestClient(app) as http:
        native = http.post("/generate", json={"input_ids": [1, 2], "image_data": [data_uri(PICTURES[0])]})
        chat = http.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(PICTURES[0])}}]}
                ]
            },
        )
    for response in (native, chat):
        assert response.status_code == 400 and "the model is text-only" in response.json()["error"]["message"], (
            response.text
        )
