"""A generative judge served beside the policy (reward_model.*), on real Ray with the tiny models: a reward function
and an environment that call it get what the judge model itself answers (the same engine run in-process), verl's
GenRM functions reach the same judge over HTTP through reward_router_address (their calls recorded as the sample's),
and a judge call that times out, a reply that cannot be read and a dead judge server each stay one sample's problem."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import urllib.error
import urllib.request

import pytest
import ray
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.judge import Judge, JudgeError
from agentloop.server.hf_engine import HFEngine
from tests.support.config import small_config
from tests.support.judges import question

RESPONSE_LENGTH = 8  # the judge's reply budget (reward_model.rollout.response_length)
# the reward functions of tests.support.judges, each the reward of the data source of its name
JUDGED_SOURCES = ("ask_the_judge", "impatient", "wants_a_number", "verl_genrm", "verl_genrm_sync")


@pytest.fixture(scope="module")
def manager(local_ray, ok_model, coin_model):
    manager = AgentLoopManager(
        small_config(
            f"actor_rollout_ref.model.path={ok_model}",
            "actor_rollout_ref.rollout.max_failed_sample_ratio=1.0",
            "reward_model.enable=true",
            f"reward_model.model.path={coin_model}",
            f"reward_model.rollout.response_length={RESPONSE_LENGTH}",
            "data.max_response_length=64",  # two turns with the judge's feedback between them
            *(f"+custom_reward_function.by_data_source.{name}=tests.support.judges.{name}" for name in JUDGED_SOURCES),
            "actor_rollout_ref.rollout.env.class_name=tests.support.judges.JudgedEnv",
        )
    )
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def judge_answers(coin_model):
    """What the judge model answers to questions 0..3, greedy, from the same engine run here in-process."""
    tokenizer = AutoTokenizer.from_pretrained(coin_model)

    async def answer_all() -> dict[int, str]:
        engine = HFEngine(coin_model, device="cpu", num_blocks=64, seed=0)
        answers = {}
        for index in range(4):
            ids = tokenizer.apply_chat_template(
                question(index), add_generation_prompt=True, tokenize=True, return_dict=False
            )
            output = await engine.generate(
                list(ids), {"max_new_tokens": RESPONSE_LENGTH, "temperature": 0.0}, f"direct-{index}"
            )
            answers[index] = tokenizer.decode(output.token_ids, skip_special_tokens=True)
        await engine.shutdown()
        return answers

    return asyncio.run(answer_all())


def rows(data_source: str, count: int = 2, **fields) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"say something {i}"}],
            "data_source": data_source,
            "extra_info": {"index": i},
            **fields,
        }
        for i in range(count)
    ]


def test_a_reward_function_awaits_the_judge(manager, judge_answers):
    batch = manager.generate_sequences(rows("ask_the_judge", 4))
    fields = batch.non_tensor_batch
    for i in range(4):
        assert fields["failure"][i] is None
        extra = fields["reward_extra_info"][i]
        assert extra["judge_text"] == judge_answers[i]
        assert fields["reward_score"][i] == float(judge_answers[i].startswith("yes"))
        (call,) = fields["judge_calls"][i]
        assert call.text == judge_answers[i] and call.error is None and call.prompt_tokens > 0
        assert call.prompt.endswith(f"question {i}<|im_end|>\n<|im_start|>assistant\n")
    assert {answer.split()[0] for answer in judge_answers.values()} <= {"yes", "no"}
    assert batch.meta_info["judge/calls"] == 4 and batch.meta_info["judge/failures"] == 0
    assert batch.meta_info["judge/response_tokens"] == sum(
        call.response_tokens for calls in fields["judge_calls"] for call in calls
    )


@pytest.mark.parametrize("source", ["verl_genrm", "verl_genrm_sync"])
def test_a_verl_genrm_function_calls_the_judge_through_reward_router_address(manager, judge_answers, source):
    """As verl calls a GenRM function: with ``reward_router_address`` (``host:port``: the function adds ``http://``) and
    ``reward_model_tokenizer``; what it gets over HTTP is what the judge answers, and each call is the sample's own."""
    batch = manager.generate_sequences(rows(source, 2))
    fields = batch.non_tensor_batch
    addresses = []
    for i in range(2):
        assert fields["failure"][i] is None
        extra = fields["reward_extra_info"][i]
        assert extra["judge_text"] == judge_answers[i]
        assert fields["reward_score"][i] == float(judge_answers[i].startswith("yes"))
        (call,) = fields["judge_calls"][i]  # recorded for its sample, as judge.chat's calls are
        assert call.text == judge_answers[i] and call.error is None and call.response_tokens > 0
        assert call.prompt.endswith(f"question {i}<|im_end|>\n<|im_start|>assistant\n")
        assert call.prompt_tokens == extra["prompt_tokens"]  # reward_model_tokenizer is the judge's
        addresses.append(extra["address"])
    assert batch.meta_info["judge/calls"] == 2 and batch.meta_info["judge/failures"] == 0
    assert not addresses[0].startswith("http") and addresses[0] != addresses[1]  # host:port..., one per sample
    # an address serves while its sample is scored: a call after it is no sample's
    body = json.dumps({"messages": question(0)}).encode()
    url = f"http://{addresses[0]}/v1/chat/completions"
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 404 and b"no sample is scored at this address" in refused.value.read()


def test_an_environment_grades_each_turn_with_the_judge(manager, judge_answers):
    batch = manager.generate_sequences(rows("judged_env", 1, agent_name="env_agent"))
    fields = batch.non_tensor_batch
    assert fields["failure"][0] is None and fields["end_reason"][0] == "done"
    turns = fields["turns"][0]
    assert [turn.env_reward for turn in turns] == [float(judge_answers[t].startswith("yes")) for t in (1, 2)]
    assert [call.text for call in fields["judge_calls"][0]] == [judge_answers[1], judge_answers[2]]
    # the judge's feedback is the observation the policy saw next
    response = AutoTokenizer.from_pretrained(manager.config.actor_rollout_ref.model.path).decode(
        batch.batch["responses"][0]
    )
    assert f"the judge says {judge_answers[1]}" in response


def test_a_judge_call_that_times_out_fails_its_sample_with_the_call_recorded(manager):
    batch = manager.generate_sequences(rows("impatient", 1) + rows("ask_the_judge", 1))
    fields = batch.non_tensor_batch
    assert "JudgeError: the judge gave no answer within 0.001s" in fields["failure"][0].error
    (call,) = fields["judge_calls"][0]
    assert call.error is not None and "within 0.001s" in call.error
    assert fields["failure"][1] is None  # the other sample of the batch is scored
    assert batch.meta_info["judge/failures"] == 1 and batch.meta_info["rollout/failed_samples"] == 1


def test_an_unreadable_reply_fails_its_sample_with_the_judges_text(manager, judge_answers):
    batch = manager.generate_sequences(rows("wants_a_number", 1))
    failure = batch.non_tensor_batch["failure"][0]
    assert "JudgeUnparsable" in failure.error and "expected a number" in failure.error
    assert repr(judge_answers[0]) in failure.error  # the judge's text
    (call,) = batch.non_tensor_batch["judge_calls"][0]
    assert call.text == judge_answers[0] and "expected a number" in call.error


def test_a_dead_judge_server_is_replaced_like_a_rollout_server(manager, judge_answers, caplog):
    doomed = manager.judges.servers[0]
    ray.kill(doomed)
    # the kill lands asynchronously (a call sent right after it can still be served): on a loaded machine the batch's
    # first probe could find the server alive and a judge call then fail with it; this test is about a server dead
    # before the batch, so it probes until a call fails
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(doomed.node_info.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed judge server still answers 60 s after ray.kill"
        time.sleep(0.1)
    # a judge with no live server left waits for a replacement (a manager starts one) within its call's bound, then
    # fails, naming the judge's servers and not the policy's
    lone = Judge.from_settings(dataclasses.replace(manager.judge_settings, timeout_s=2.0), [doomed])
    with caplog.at_level(logging.WARNING, logger="agentloop.router.router"):
        with pytest.raises(JudgeError, match=r"the judge gave no answer within 2s \(reward_model.timeout_s\)"):
            asyncio.run(lone.chat(question(0)))
    assert "judge server 0 failed" in caplog.text and "re-homing session judge-" in caplog.text
    assert "rollout server" not in caplog.text
    batch = manager.generate_sequences(rows("ask_the_judge", 2))
    assert batch.meta_info["supervision/judge_restarts"] == 1
    assert [extra["judge_text"] for extra in batch.non_tensor_batch["reward_extra_info"]] == [
        judge_answers[0],
        judge_answers[1],
    ]
