"""The session gateway under load: 64 OpenAI SDK agents at once, through one gateway and router to two real servers,
each session recording exactly its own conversation (no token of another session, each reply sampled from its own
context)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop.agent_loop.trajectory import observation_delta
from agentloop.gateway import Gateway, Session
from agentloop.router import Router
from agentloop.server.rollout_server import RolloutServer
from tests.support.config import small_config
from tests.test_hf_engine import LOGPROB_TOLERANCE, teacher_forced_logprobs
from agentloop.settings import rollout_settings

SESSIONS, CALLS, NEW_TOKENS = 64, 3, 4
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True, "max_new_tokens": NEW_TOKENS}


@pytest.fixture(scope="module")
def config(model_path):
    return small_config(
        f"actor_rollout_ref.model.path={model_path}",
        "data.max_response_length=64",
        "actor_rollout_ref.rollout.resources_per_server.CPU=1",
    )


@pytest.fixture(scope="module")
def servers(local_ray, config):
    servers = [RolloutServer.remote(rollout_settings(config).servers, rank) for rank in range(2)]
    ray.get([server.__ray_ready__.remote() for server in servers], timeout=300)
    yield servers
    for server in servers:
        ray.kill(server)


def question(index: int, call: int) -> dict[str, str]:
    return {"role": "user", "content": f"session {index} asks question {call}"}


async def agent(gateway: Gateway, index: int) -> tuple[Session, list[Any]]:
    """Sample ``index``'s agent: CALLS calls, each sending the conversation so far (the replies as the SDK returned
    them) and its own next question; its session and the completions it got."""
    with Router.running_sample(f"sample-{index}"):
        session = gateway.open(SAMPLING, timeout_s=120, max_tokens_per_call=None)
    messages: list[dict[str, Any]] = []
    completions = []
    try:
        async with AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.api_key, max_retries=0) as client:
            for call in range(CALLS):
                messages.append(question(index, call))
                completion = await client.chat.completions.create(model="m", messages=messages)
                messages.append(completion.choices[0].message.model_dump(exclude_none=True))
                completions.append(completion)
    finally:
        await gateway.close(session)
    return session, completions


def test_64_concurrent_sessions_on_two_servers_record_exactly_their_own_calls(servers, config, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    router = Router(servers)

    async def run_all() -> list[tuple[Session, list[Any]]]:
        gateway = Gateway(router, tokenizer, rollout_settings(config))
        await gateway.start()
        try:
            return await asyncio.gather(*(agent(gateway, index) for index in range(SESSIONS)))
        finally:
            gateway.stop()

    results = asyncio.run(run_all())
    assert {router.server_of(f"sample-{index}") for index in range(SESSIONS)} == {0, 1}

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    for index, (session, completions) in enumerate(results):
        trajectory = session.trajectory
        # what this session's calls alone make: its first question rendered, then per call the tokens returned for
        # it, and the end of turn and template delta of its own next question
        ids = list(tokenizer.apply_chat_template([question(index, 0)], add_generation_prompt=True, return_dict=False))
        assert trajectory.prompt_ids == ids
        mask: list[int] = []
        for call, completion in enumerate(completions):
            if call:
                delta = ([] if ids[-1] == eos else [eos]) + observation_delta(tokenizer, [question(index, call)])
                ids, mask = ids + delta, mask + [0] * len(delta)
            assert completion.prompt_token_ids == ids, (
                f"session {index}, call {call}: the context of another conversation"
            )
            choice = completion.choices[0]
            assert len(choice.token_ids) == NEW_TOKENS
            ids, mask = ids + choice.token_ids, mask + [1] * NEW_TOKENS
            sent = [entry.logprob for entry in choice.logprobs.content]
            assert trajectory.response_logprobs[len(mask) - NEW_TOKENS : len(mask)] == sent
        assert trajectory.ids == ids and trajectory.response_mask == mask, f"session {index}: tokens it was never given"
        # each reply was sampled under this session's own context: the engine's logprobs are the model's there
        sampled = torch.tensor(mask, dtype=torch.bool)
        reference = teacher_forced_logprobs(model, trajectory.prompt_ids, trajectory.response_ids)[sampled]
        assert torch.allclose(torch.tensor(trajectory.response_logprobs)[sampled], reference, atol=LOGPROB_TOLERANCE), (
            index
        )
