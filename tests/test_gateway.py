"""The session gateway and ``external_agent``: unmodified OpenAI-SDK programs on a real engine, their calls recorded
as exact-token trajectories (one segment while calls extend each other), limits enforced, hostile clients and
programs failing only their own sample."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from pathlib import Path
from unittest.mock import ANY

import httpx
import pytest
import ray
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop.agent_loop.external_agent import ExternalAgentLoop
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.dumps import mask_runs
from agentloop.gateway import Gateway
from agentloop.gateway.session import _key
from agentloop.postprocess import pad_outputs
from agentloop.preflight import check_job
from agentloop.rewards import score_output
from agentloop.router import Router
from agentloop.server.rollout_server import RolloutServer
from agentloop.worker import AgentLoopWorker
from tests.support.config import small_config
from tests.support.external_agents import SCHEMAS
from tests.support.models import SCRIPTS, script_row
from tests.support.ranks import manager_and_two_ranks, scores
from tests.test_contexts import teacher_forced
from tests.test_tool_agent import GREEDY, run_loop, tool_config
from agentloop.settings import rollout_settings, reward_settings

SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
AGENTS = "tests.support.external_agents"
EXTERNAL = "agentloop.agent_loop.external_agent.ExternalAgentLoop"
AGENTS_YAML = str(Path(__file__).parent / "support" / "external_agents.yaml")


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
    return AutoTokenizer.from_pretrained(scripted.path)


@pytest.fixture(scope="module")
def model(scripted):
    return AutoModelForCausalLM.from_pretrained(scripted.path, dtype=torch.float32)


async def run_external(server, tokenizer, scripted, *overrides, sampling=GREEDY, row=None, after=None, **loop_kwargs):
    """One ExternalAgentLoop in this process over the real server; ``after(gateway_url)`` runs once it is done."""
    router, config = Router([server]), tool_config(scripted, *overrides)
    gateway = Gateway(router, tokenizer, rollout_settings(config))
    loop = ExternalAgentLoop(server_manager=router, tokenizer=tokenizer, config=config, gateway=gateway, **loop_kwargs)
    row = {**(row or script_row("multi")), "request_id": f"external-{id(loop)}"}
    with Router.running_sample(row["request_id"]):
        try:
            return await loop.run(dict(sampling), **row)
        finally:
            if after is not None:
                await after()
            gateway.stop()


def external(server, tokenizer, scripted, *overrides, **kwargs):
    return asyncio.run(run_external(server, tokenizer, scripted, *overrides, **kwargs))


def assert_exact(model, output):
    """Every segment's model tokens carry the logprob a teacher-forced forward gives them; observations 0."""
    for segment in output.all_segments():
        mask = torch.tensor(segment.response_mask).bool()
        rollout = torch.tensor(segment.response_logprobs)
        assert torch.allclose(rollout[mask], teacher_forced(model, segment)[mask], atol=1e-4)
        assert torch.all(rollout[~mask] == 0)


def test_an_openai_sdk_agent_is_one_segment_with_exact_model_tokens_and_masked_tool_outputs(
    server, tokenizer, scripted, model
):
    output = external(server, tokenizer, scripted, function=f"{AGENTS}.scripted_openai")
    assert output.end_reason == "stop" and not output.segments and output.metrics["gateway_calls"] == 3
    runs = mask_runs(output.response_mask)
    assert [value for value, _, _ in runs] == [1, 0, 1, 0, 1]
    # the script replayed although the client asked for temperature 1.9: the rollout's (greedy) params hold
    texts = [tokenizer.decode(output.response_ids[a:b]) for value, a, b in runs if value == 1]
    assert texts == [turn + "<|im_end|>" for turn in SCRIPTS["multi"]]
    # the tool results the client added are observation tokens, exactly the template's delta (as in tool_agent)
    observations = [output.response_ids[a:b] for value, a, b in runs if value == 0]
    assert observations == [
        observation_delta(tokenizer, [{"role": "tool", "content": text}]) for text in ("5", "correct")
    ]
    assert output.reward_score is None  # it returned None and the row's data source has no reward function
    # the turns record the calls the client ran and the results it sent back, as tool_agent's do
    assert [(call.name, call.arguments, call.result) for turn in output.turns for call in turn.calls] == [
        ("calculator", {"expression": "2 + 3"}, "5"),
        ("submit_answer", {"answer": 5}, "correct"),
    ]

    sampled = external(server, tokenizer, scripted, function=f"{AGENTS}.scripted_openai", sampling=SAMPLED)
    assert_exact(model, sampled)


@pytest.mark.parametrize("rewrite", ["repeat", "edit"])
def test_a_client_that_rewrites_history_starts_a_second_exact_segment(server, tokenizer, scripted, model, rewrite):
    row = script_row("multi", extra_info={"rewrite": rewrite})
    output = external(server, tokenizer, scripted, function=f"{AGENTS}.rewriting_openai", row=row, sampling=SAMPLED)
    segments = output.all_segments()
    assert len(segments) == 2 and [segment.rewritten_by for segment in segments] == [None, "client"]
    assert all(segment.response_mask and segment.response_mask[0] == 1 for segment in segments)
    if rewrite == "edit":  # the edited reply is part of the new context, rendered from its text
        assert "I will compute 2 + 3.<|im_end|>" in tokenizer.decode(segments[1].prompt_ids)
    else:
        assert segments[1].prompt_ids == segments[0].prompt_ids
    assert_exact(model, output)


def test_a_streaming_client_gets_the_same_replies(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, function=f"{AGENTS}.streaming_openai")
    plain = external(server, tokenizer, scripted, function=f"{AGENTS}.scripted_openai")
    assert output.reward_score == 1.0 and not output.segments
    assert (output.prompt_ids, output.response_ids, output.response_mask) == (
        plain.prompt_ids,
        plain.response_ids,
        plain.response_mask,
    )


def test_a_command_agent_gets_its_session_from_the_environment_and_its_reward_from_stdout(server, tokenizer, scripted):
    output = external(server, tokenizer, scripted, command=f"{sys.executable} -m {AGENTS}")
    plain = external(server, tokenizer, scripted, function=f"{AGENTS}.scripted_openai")
    assert output.reward_score == 0.25 and output.response_ids == plain.response_ids


def test_without_a_returned_reward_the_data_source_scores_the_final_assistant_message(server, tokenizer, scripted):
    row = script_row("multi", data_source="arith", reward_model={"ground_truth": 5})
    reward = "+custom_reward_function.by_data_source.arith=agentloop.tasks.arithmetic.reward.arithmetic_score"
    output = external(server, tokenizer, scripted, reward, function=f"{AGENTS}.scripted_openai", row=row)
    # the loop leaves the reward to the worker's scoring step, handing it the program's final answer to score
    assert output.reward_score is None and output.solution_str == SCRIPTS["multi"][-1]
    score = asyncio.run(score_output(reward_settings(tool_config(scripted, reward)), tokenizer, row, output))
    assert output.reward_score == 1.0 and score.reward_source == "reward_function"


def test_an_external_agents_reward_function_gets_the_arguments_a_tool_loops_gets(server, tokenizer, scripted):
    # one reward call for every loop: the external agent's (on its final message) takes the rule's arguments too
    reward = f"+custom_reward_function.by_data_source.arith={AGENTS}.recording_reward"
    fields = {"data_source": "arith", "reward_model": {"ground_truth": 5}, "extra_info": {"index": 3}}
    external_output = external(
        server, tokenizer, scripted, reward, function=f"{AGENTS}.scripted_openai", row=script_row("multi", **fields)
    )
    tool_output = run_loop(server, tokenizer, scripted, "multi", reward, **fields)
    external_score, tool_score = (
        asyncio.run(
            score_output(
                reward_settings(tool_config(scripted, reward)), tokenizer, script_row("multi", **fields), output
            )
        )
        for output in (external_output, tool_output)
    )
    assert external_score.reward_source == tool_score.reward_source == "reward_function"
    assert external_score.reward_extra_info == tool_score.reward_extra_info
    assert external_score.reward_extra_info["extra_info"] == ["index", "num_turns", "rollout_reward_scores"]
    assert external_score.reward_extra_info["ground_truth"] == 5


def test_the_worker_makes_its_gateway_for_the_first_external_agent_and_stops_it_at_shutdown(server, scripted):
    loops = {"external_agent": {"_target_": EXTERNAL, "function": f"{AGENTS}.scripted_openai"}}
    row = {**script_row("multi"), "agent_name": "external_agent", "request_id": "owned-0", "index": 0, "uid": "u"}

    async def run() -> None:
        config = tool_config(scripted)
        worker = AgentLoopWorker(config, rollout_settings(config), None, [server])
        assert worker._gateway is None  # no loop has asked for it yet
        batch, _ = await worker.generate_sequences([row], GREEDY, loops)
        assert batch.non_tensor_batch["end_reason"][0] == "stop" and worker.gateway() is worker._gateway
        url = worker.gateway().url
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(f"{url}/sessions/none/v1/models")).status_code == 404  # serving
            unknown, wrong_method = (
                await http.get(f"{url}/sessions/none/v1/nowhere"),
                await http.get(f"{url}/sessions/none/v1/chat/completions"),
            )
            assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "not_found")
            assert (wrong_method.status_code, wrong_method.json()["error"]["code"]) == (405, "method_not_allowed")
            worker.shutdown()
            for _ in range(100):  # uvicorn notices should_exit within a tick (0.1 s)
                try:
                    await http.get(f"{url}/sessions/none/v1/models")
                except httpx.ConnectError:
                    return
                await asyncio.sleep(0.05)
        raise AssertionError(f"the gateway at {url} still serves after its worker's shutdown")

    asyncio.run(run())


def test_the_token_budget_ends_the_session_with_length_and_keeps_the_trajectory(server, tokenizer, scripted, model):
    # 30 response tokens: the first reply (22 tokens) fits, its tool result and a second reply do not
    output = external(server, tokenizer, scripted, "data.max_response_length=30", function=f"{AGENTS}.scripted_openai")
    assert output.end_reason == "length" and output.metrics["gateway_calls"] == 1
    assert output.response_mask == [1] * len(output.response_ids) and len(output.response_ids) <= 30
    capped = external(server, tokenizer, scripted, function=f"{AGENTS}.scripted_openai", max_tokens_per_call=4)
    assert capped.end_reason == "length" and len(capped.response_ids) == 4  # the reply was cut: nothing to call


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"function": f"{AGENTS}.silent"}, "made no model call"),
        (
            {"function": f"{AGENTS}.hangs", "timeout_s": 2},
            "ran past actor_rollout_ref.rollout.agent.external.timeout_s=2s after 1 model call",
        ),
        (
            {"command": f"{sys.executable} -c \"import sys; sys.stderr.write('boom'); sys.exit(3)\""},
            "exited with 3; stderr tail:\nboom",
        ),
        ({"command": "sleep 60", "timeout_s": 2}, "ran past"),
        ({"function": "tests.support.no_such_module.agent"}, "cannot be imported"),
        ({}, "needs exactly one of"),
    ],
)
def test_a_failing_program_fails_its_sample_with_the_reason(server, tokenizer, scripted, kwargs, message):
    with pytest.raises(Exception, match=message):
        external(server, tokenizer, scripted, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            (),
            "rows use external_agent: external_agent needs exactly one of actor_rollout_ref.rollout.agent.external.function",
        ),
        (("actor_rollout_ref.rollout.agent.external.function=examples.no_such.agent",), "cannot be imported"),
    ],
)
def test_a_job_whose_rows_run_external_agent_without_a_program_does_not_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_job(small_config(*overrides), {"train": [{**script_row("multi"), "agent_name": "external_agent"}]})


def test_hostile_requests_get_4xx_and_leave_the_session_working(server, tokenizer, scripted):
    seen: dict[str, int] = {}
    urls: list[str] = []

    async def hostile(base_url: str, api_key: str, row: dict) -> float:
        urls.append(base_url)
        good = {"model": "m", "messages": row["prompt"]}
        async with httpx.AsyncClient(timeout=60) as http:

            async def post(
                name: str, url: str = base_url, key: str = api_key, headers: dict | None = None, **kwargs
            ) -> None:
                headers = {"Authorization": f"Bearer {key}", **(headers or {})}
                reply = await http.post(f"{url}/chat/completions", headers=headers, **kwargs)
                seen[name] = reply.status_code
                assert reply.status_code == 200 or {"message", "type", "code"} <= set(reply.json()["error"])
                if name == "no messages":  # a body that fails validation is answered naming the field
                    assert reply.json()["error"]["message"].startswith("malformed request: messages")

            await post("malformed json", content=b'{"messages": [', headers={"content-type": "application/json"})
            await post("huge body", json={**good, "user": "x" * 20_000})
            reply = await http.post(f"{base_url}/messages", json={**good, "max_tokens": 8, "system": "x" * 20_000})
            seen["huge body to /messages"] = reply.status_code  # in Anthropic's error shape there
            assert reply.json() == {"type": "error", "error": {"type": "request_too_large", "message": ANY}}
            await post("unknown session", url=base_url.replace("/sessions/", "/sessions/x"), json=good)
            await post("wrong key", key="guess", json=good)
            await post("n=2", json={**good, "n": 2})
            await post("no messages", json={**good, "messages": []})
            await post(
                "bad tool arguments",
                json={
                    **good,
                    "messages": [
                        *row["prompt"],
                        {
                            "role": "assistant",
                            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}],
                        },
                    ],
                },
            )
            await post("good", json=good)
            models = await http.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"})
            seen["models"] = models.status_code
        return 1.0

    async def after() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            reply = await http.post(
                f"{urls[0]}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            seen["after the end"] = reply.status_code

    import tests.support.external_agents as agents

    agents.hostile = hostile
    output = external(
        server,
        tokenizer,
        scripted,
        "actor_rollout_ref.rollout.agent.gateway.max_body_bytes=8192",
        function=f"{AGENTS}.hostile",
        after=after,
    )
    assert seen == {
        "malformed json": 400,
        "huge body": 413,
        "huge body to /messages": 413,
        "unknown session": 404,
        "wrong key": 401,
        "n=2": 400,
        "no messages": 400,
        "bad tool arguments": 400,
        "good": 200,
        "models": 200,
        "after the end": 404,
    }
    assert output.reward_score == 1.0 and output.metrics["gateway_calls"] == 1


@pytest.mark.parametrize(
    "null_content",
    [{"role": "tool", "tool_call_id": "x", "content": None}, {"role": "user", "content": None}],
    ids=["tool", "user"],
)
def test_a_malformed_continuation_gets_the_first_calls_400_and_leaves_no_trace(
    server, tokenizer, scripted, null_content
):
    seen: dict[str, tuple[int, str]] = {}

    async def continuing(base_url: str, api_key: str, row: dict) -> float:
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {api_key}"}) as http:

            async def post(name: str, messages: list[dict]) -> dict:
                body = {"model": "m", "messages": messages, "tools": SCHEMAS}
                reply = await http.post(f"{base_url}/chat/completions", json=body)
                seen[name] = (reply.status_code, reply.text)
                return reply.json() if reply.status_code == 200 else {}

            await post("first call", [*row["prompt"], null_content])
            first = await post("good first call", row["prompt"])
            history = [*row["prompt"], first["choices"][0]["message"]]
            await post("continuation", [*history, null_content])
            call_id = first["choices"][0]["message"]["tool_calls"][0]["id"]
            await post("good continuation", [*history, {"role": "tool", "tool_call_id": call_id, "content": "5"}])
        return 1.0

    import tests.support.external_agents as agents

    agents.continuing = continuing
    output = external(server, tokenizer, scripted, function=f"{AGENTS}.continuing")
    statuses = {name: status for name, (status, _) in seen.items()}
    assert statuses == {"first call": 400, "good first call": 200, "continuation": 400, "good continuation": 200}, seen
    for name in ("first call", "continuation"):  # the same error either way, naming the template's complaint
        assert "the chat template cannot render these messages: UndefinedError" in seen[name][1]
    # the refused continuation recorded nothing: the trajectory is the two answered calls', the result the good one's
    assert output.metrics["gateway_calls"] == 2 and not output.segments and output.observation_roles == ["tool"]
    runs = mask_runs(output.response_mask)
    assert [value for value, _, _ in runs] == [1, 0, 1]
    observation = output.response_ids[runs[1][1] : runs[1][2]]
    assert observation == observation_delta(tokenizer, [{"role": "tool", "content": "5"}])
    assert [call.result for call in output.turns[0].calls] == ["5"]


@pytest.mark.parametrize("late", ["extends", "rewrites"])
def test_a_call_in_flight_when_the_program_returns_leaves_nothing_and_the_reward_sits_on_the_last_model_token(
    server, tokenizer, scripted, late
):
    """The program returns 1.0 while a call it started from a thread is being generated: the session's close
    cancels the call (its client gets 404), and what the call had recorded (an observation, or a new segment)
    is taken back before the trajectory is read; the batch holds the reward on the first call's last token."""
    answered: list[list[int]] = []
    late_outcome: list[tuple[int, str]] = []
    threads: list[threading.Thread] = []

    async def returns_early(base_url: str, api_key: str, row: dict) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = await client.chat.completions.create(model="m", messages=row["prompt"], tools=SCHEMAS, max_tokens=4)
        answered.append(first.choices[0].token_ids)
        history = [*row["prompt"], first.choices[0].message.model_dump(exclude_none=True)]
        messages = [*history, {"role": "user", "content": "go on"}] if late == "extends" else row["prompt"]

        def late_call() -> None:  # no max_tokens, and eos ignored: it runs to the session's budget, for seconds
            body = {"model": "m", "messages": messages, "tools": SCHEMAS}
            headers = {"Authorization": f"Bearer {api_key}"}
            reply = httpx.post(f"{base_url}/chat/completions", json=body, headers=headers, timeout=60)
            late_outcome.append((reply.status_code, reply.json()["error"]["code"] if reply.status_code != 200 else ""))

        threads.append(threading.Thread(target=late_call))
        threads[0].start()
        deadline = time.monotonic() + 60
        while ray.get(server.in_flight.remote()) == 0:  # (this thread is the program's own: it may block)
            assert time.monotonic() < deadline, "the late call never reached the engine"
            time.sleep(0.01)
        return 1.0

    import tests.support.external_agents as agents

    agents.returns_early = returns_early
    sampling = {**GREEDY, "ignore_eos": True}
    output = external(server, tokenizer, scripted, function=f"{AGENTS}.returns_early", sampling=sampling)
    threads[0].join(timeout=60)
    assert late_outcome == [(404, "session_ended")], "the late call was not in flight at the close"
    assert output.reward_score == 1.0 and output.metrics["gateway_calls"] == 1
    assert not output.segments and output.observation_roles == [] and len(output.turns) == 1
    assert output.response_ids == answered[0] and output.response_mask == [1] * len(answered[0])
    config = tool_config(scripted).actor_rollout_ref.rollout
    batch = pad_outputs([output], int(config.prompt_length), int(config.response_length), tokenizer.pad_token_id)
    assert batch["rm_scores"].sum().item() == output.reward_score
    assert batch["rm_scores"][0, len(answered[0]) - 1].item() == output.reward_score
    deadline = time.monotonic() + 30  # and the engine stopped generating it (the router aborted the request)
    while ray.get(server.in_flight.remote()):
        assert time.monotonic() < deadline, "the cancelled call's request is still generating"
        time.sleep(0.05)


def test_through_the_manager_each_failure_stays_its_own_and_the_ranks_rescore_every_segment_as_recorded(
    local_ray, scripted
):
    config = tool_config(
        scripted,
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={AGENTS_YAML}",
        "actor_rollout_ref.rollout.max_failed_sample_ratio=0.5",
    )
    rows = [
        {**script_row("multi"), "agent_name": "scripted_agent"},
        {**script_row("multi", extra_info={"rewrite": "edit"}), "agent_name": "rewriting_agent"},
        {**script_row("multi"), "agent_name": "hanging_agent"},
        {**script_row("multi"), "agent_name": "crashing_command"},
    ]
    setup = manager_and_two_ranks(config)
    manager, actors = next(setup)
    try:
        batch = manager.generate_sequences(rows)
        tensors = batch.batch
        mask = tensors["response_mask"].bool()
        assert torch.allclose(scores(actors, tensors)[mask], tensors["rollout_log_probs"][mask], atol=1e-4)
    finally:
        next(setup, None)
    fields = batch.non_tensor_batch
    assert batch.num_trajectories == 4 and len(batch) == 5  # the rewriting agent's trajectory has two rows
    assert tensors["segment_index"].tolist() == [0, 0, 1, 0, 0]
    assert fields["rewritten_by"].tolist() == [None, None, "client", None, None]
    assert [failure is None for failure in fields["failure"]] == [True, True, True, False, False]
    assert "timeout_s=3s after 1 model call" in fields["failure"][3].error
    assert "exited with 3; stderr tail:\nboom" in fields["failure"][4].error
    assert fields["metrics"][0]["gateway_calls"] >= 1 and fields["end_reason"][2] in ("stop", "length")


def test_a_message_sent_back_is_the_recorded_one_only_when_its_json_value_is():
    # the key a call's messages are matched on (orjson, the standard library's where orjson writes null): key order
    # and the fields clients drop from a reply do not count; a value's JSON type and NaN against null do
    def same(sent: dict, recorded: dict) -> bool:
        return _key(sent) == _key(recorded)

    assert same({"content": "x", "role": "user"}, {"role": "user", "content": "x"})
    assert same({"role": "assistant", "content": "a"}, {"role": "assistant", "content": "a", "reasoning_content": "r"})
    assert same(
        {"role": "tool", "content": "7", "extra": {"n": 2**70}}, {"role": "tool", "content": "7", "extra": {"n": 2**70}}
    )
    for sent, recorded in [(1, True), (1, 1.0), (math.nan, None), (math.inf, None), ("null", None), (None, [])]:
        assert not same({"role": "user", "content": "x", "v": sent}, {"role": "user", "content": "x", "v": recorded})
    assert same({"role": "user", "v": None, "w": [None]}, {"w": [None], "v": None, "role": "user"})
    calls = [{"function": {"name": "f", "arguments": {"a": 1}}}]
    assert not same(
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": True}}}]},
    )
