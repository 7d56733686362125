"""HTTP on every rollout server: SGLang's /generate contract, OpenAI chat completions, API keys, abort."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray
import requests
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from agentloop import AgentLoopManager
from agentloop.server.http.chat import token_bytes
from agentloop.tools.toolset import load_tool_set
from tests.support.config import small_config
from tests.support.models import SCRIPTS, script_row
from tests.support.sglang_contract import load_api_types

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
api_types = load_api_types()
needs_sglang = pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")


@pytest.fixture(scope="module")
def scripted(scripted_model):
    return scripted_model


@pytest.fixture(scope="module")
def manager(local_ray, scripted):
    manager = AgentLoopManager(
        small_config(
            f"actor_rollout_ref.model.path={scripted[1]}",
            f"actor_rollout_ref.rollout.http.api_key={API_KEY}",
            "data.max_prompt_length=768",
        )
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def url(manager):
    [address] = manager.server_addresses
    assert address.startswith("http://127.0.0.1:")
    return address


def post(url, path, body, headers=AUTH):
    return requests.post(url + path, json=body, headers=headers, timeout=60)


def generate_request(**overrides):
    body = {
        "input_ids": [1, 294, 207, 664, 2, 207, 1, 299, 207],
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 1073741824,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
        "rid": "contract-1",
    }
    body.update(overrides)
    return body


def test_health_and_api_key(url):
    assert requests.get(url + "/health", timeout=10).json() == {"status": "ok"}
    assert requests.get(url + "/health_generate", headers=AUTH, timeout=30).status_code == 200
    assert post(url, "/generate", generate_request(), headers={}).status_code == 401
    assert post(url, "/generate", generate_request(), headers={"Authorization": "Bearer wrong"}).status_code == 401


@needs_sglang
def test_generate_request_and_response_follow_sglangs_contract(url, manager):
    request = generate_request()
    api_types.GenerateRequest.from_json_value(request)  # what we send is valid for SGLang
    response = post(url, "/generate", request)
    assert response.status_code == 200, response.text
    decoded = api_types.GenerateResponse.from_json_value(response.json())
    assert list(decoded.output_ids) == response.json()["output_ids"] and len(decoded.output_ids) == 5
    body = response.json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    logprobs = body["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == body["output_ids"] and all(entry[0] < 0 for entry in logprobs)
    assert body["meta_info"]["prompt_tokens"] == 9 and body["meta_info"]["completion_tokens"] == 5
    # SGLang's weight-version report: one span of the weights loaded, over every output token
    version = str(
        ray.get(
            manager.servers[0].generate.remote([5], {"max_new_tokens": 1}, "version-probe"), timeout=60
        ).policy_version
    )
    assert body["meta_info"]["weight_version"] == version
    assert body["meta_info"]["weight_versions"] == [{"version": version, "start": 0, "end": 5}]


def test_generate_stops_on_eos_and_rejects_unknown_keys(url, scripted):
    # a prompt the scripted model was trained on: its greedy answer ends in <|im_end|> by a wide margin
    tokenizer = AutoTokenizer.from_pretrained(scripted[1])
    prompt_ids = tokenizer.apply_chat_template(
        script_row("think")["prompt"],
        tools=load_tool_set(scripted[0]).schemas,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    params = {"max_new_tokens": 64, "temperature": 0.0}
    body = post(url, "/generate", generate_request(input_ids=prompt_ids, sampling_params=params)).json()
    eos = body["output_ids"][-1]
    assert tokenizer.decode(body["output_ids"]) == SCRIPTS["think"][0] + "<|im_end|>"
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    bad = post(url, "/generate", generate_request(sampling_params={"max_new_tokens": 4, "frequency_penalty": 0.5}))
    assert (
        bad.status_code == 400 and "unsupported sampling_params ['frequency_penalty']" in bad.json()["error"]["message"]
    )


def test_abort_request(url):
    request = generate_request(rid="to-abort", sampling_params={"max_new_tokens": 4000, "ignore_eos": True})
    result = {}
    thread = threading.Thread(target=lambda: result.update(post(url, "/generate", request).json()))
    thread.start()
    deadline = time.monotonic() + 30
    # until the request has reached the engine there is nothing to abort: 404
    while (aborted := post(url, "/abort_request", {"rid": "to-abort"})).status_code != 200:
        assert aborted.status_code == 404 and time.monotonic() < deadline, aborted.text
        time.sleep(0.1)
    assert aborted.json() == {"aborted": 1}
    thread.join(timeout=30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"


def test_logprob_bytes_spell_characters_split_across_tokens(model_path):
    text = "na\u00efve \u2713 \U0001f600"
    # byte-level BPE (the tiny model's, as Qwen's): pieces of characters are bytes of their own
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids), "no token holds part of a character"
    spell = token_bytes(tokenizer)
    assert b"".join(bytes(spell(token)) for token in ids) == (text + "<|im_end|>").encode()
    # SentencePiece with byte fallback (as Llama 2's): "\u2581" pieces for spaces, <0xHH> pieces for the rest
    vocab = {"<unk>": 0, **{f"<0x{byte:02X}>": 1 + byte for byte in range(256)}}
    vocab.update(
        {
            piece: len(vocab) + i
            for i, piece in enumerate(["\u2581", "n", "a", "\u00ef", "v", "e", "\u2581n", "\u2581na"])
        }
    )
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[("\u2581", "n"), ("\u2581n", "a")], unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sentencepiece = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = sentencepiece.encode(text, add_special_tokens=False)
    assert "<0xE2>" in sentencepiece.convert_ids_to_tokens(ids)
    spell = token_bytes(sentencepiece)
    assert b"".join(bytes(spell(token)) for token in ids) == (" " + text).encode()  # the prepended space included
    # a byte-level vocabulary with a piece that is no bytes (a tokenizer assembled by hand): its text, not an error
    byte_vocab = {character: i for i, character in enumerate(bytes_to_unicode().values())}
    byte_vocab["\u4e2d"] = len(byte_vocab)
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    assert token_bytes(PreTrainedTokenizerFast(tokenizer_object=backend))(byte_vocab["\u4e2d"]) == list(
        "\u4e2d".encode()
    )


def test_openai_client_with_tool_calls(url, scripted):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=60)
    tools = load_tool_set(scripted[0]).schemas
    messages = [{"role": "user", "content": "script multi"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=tools, temperature=0.0, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2 + 3"}
    # exact tokens ride along for training
    extra = first.model_extra
    assert len(extra["prompt_token_ids"]) == first.usage.prompt_tokens
    assert len(choice.model_extra["token_ids"]) == first.usage.completion_tokens == len(choice.logprobs.content)
    tokenizer = AutoTokenizer.from_pretrained(scripted[1])
    spelled = b"".join(bytes(entry.bytes) for entry in choice.logprobs.content).decode()  # a byte-level tokenizer
    assert spelled == tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=False)

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, temperature=0.0, max_tokens=64
    )
    [answer] = second.choices[0].message.tool_calls
    assert answer.function.name == "submit_answer" and json.loads(answer.function.arguments) == {"answer": 5}
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert plain.choices[0].message.tool_calls is None and plain.usage.completion_tokens <= 4


def test_chat_messages_are_given_to_the_template_as_it_takes_them(url):
    def prompt_ids(messages):
        answer = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        return answer.json()["prompt_token_ids"]

    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}
    parsed = {**call, "function": {**call["function"], "arguments": {"expression": "2 + 3"}}}
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    as_openai_sends = [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "2 + 3?"}]},
        *turns,
    ]
    as_templates_take = [{"role": "user", "content": "what is 2 + 3?"}, {**turns[0], "tool_calls": [parsed]}, turns[1]]
    assert prompt_ids(as_openai_sends) == prompt_ids(as_templates_take)
    broken = [
        as_openai_sends[0],
        {**turns[0], "tool_calls": [{**call, "function": {"name": "calculator", "arguments": "{2 +"}}]},
    ]
    answer = post(url, "/v1/chat/completions", {"messages": broken})
    assert answer.status_code == 400 and "messages[1].tool_calls: arguments are not valid JSON" in answer.text
    assert post(url, "/v1/chat/completions", {"messages": as_openai_sends, "max_tokens": 0}).status_code == 422


def test_pause_holds_chat_requests_too_and_an_asleep_engine_answers_503(url):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    result = {}
    chat = threading.Thread(target=lambda: result.update(answer=post(url, "/v1/chat/completions", body)))
    chat.start()
    time.sleep(0.5)
    held = chat.is_alive()
    assert post(url, "/continue_generation", {}).status_code == 200
    chat.join(timeout=30)
    assert held and result["answer"].status_code == 200
    assert post(url, "/abort_request", {"abort_all": True}).json() == {
        "aborted": 0
    }  # SGLang's abort-all; nothing in flight
    assert post(url, "/release_memory_occupation", {}).status_code == 200
    try:
        asleep = post(url, "/v1/chat/completions", body)
        assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    finally:
        assert post(url, "/resume_memory_occupation", {}).status_code == 200
