"""OpenEnv environments (the real ``openenv-core`` package) through ``OpenEnvEnv`` and ``env_agent`` on the "ok" model:
in-process and over their own server on 127.0.0.1 (``create_app`` under uvicorn, reached by ``GenericEnvClient``), the
opening observation after the row's prompt, each step's observation the template's delta, its reward the turn's; an
environment that raises, hangs or returns a malformed observation ends its own trajectory (``env_error``, the failures
counted by kind), a server that dies mid-episode ends its trajectory so, and a server that died before the episode fails
its sample with the client's error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.dumps import mask_runs
from agentloop.envs.openenv_env import OpenEnvEnv
from agentloop.turn_totals import env_retries_by_kind
from tests.support.config import small_config

ENVS = "tests.support.openenv_envs"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(app: str = "app") -> tuple[subprocess.Popen, str]:
    """An environment's own server (its ``create_app``) under uvicorn on a free port, once healthy."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", f"{ENVS}:{app}", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return process, url
        except requests.RequestException:
            pass
        assert process.poll() is None, "the OpenEnv server exited before it was healthy"
        time.sleep(0.5)
    stop(process)
    raise TimeoutError("the OpenEnv server was not healthy within 120 s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


@pytest.fixture(scope="module")
def server_url():
    process, url = start_server()
    yield url
    stop(process)


@pytest.fixture(scope="module")
def dead_server_url():
    """The URL of a server that served, then died."""
    process, url = start_server()
    stop(process)
    return url


def in_process(environment: str) -> dict:
    return {"environment": f"{ENVS}.{environment}", "action": f"{ENVS}.SayAction"}


def env_row(env_kwargs: dict) -> dict:
    return {
        "prompt": [{"role": "user", "content": "start 1"}],
        "agent_name": "env_agent",
        "data_source": "openenv",
        "extra_info": {"env_kwargs": {"class_name": "agentloop.envs.openenv_env.OpenEnvEnv", **env_kwargs}},
    }


@pytest.fixture(scope="module")
def dying_server_url():
    """The URL of a server whose process exits on an episode's second step."""
    process, url = start_server("dying_app")
    yield url
    stop(process)


@pytest.fixture(scope="module")
def batch(local_ray, ok_model, server_url, dead_server_url, dying_server_url):
    manager = AgentLoopManager(
        small_config(
            f"actor_rollout_ref.model.path={ok_model}",
            "data.max_response_length=128",
            "actor_rollout_ref.rollout.env.max_turns=4",
            "actor_rollout_ref.rollout.env.step_timeout_s=3",
            "actor_rollout_ref.rollout.env.max_env_retries_per_turn=1",
            "actor_rollout_ref.rollout.max_failed_sample_ratio=1.0",
        )
    )
    try:
        rows = [
            env_row(in_process("CountingEnvironment")),
            env_row({"base_url": server_url, "action_field": "message"}),
            env_row(in_process("RaisingEnvironment")),
            env_row(in_process("HangingEnvironment")),
            env_row(in_process("MalformedEnvironment")),
            env_row({"base_url": dead_server_url, "action_field": "message"}),
            env_row({"base_url": dying_server_url, "action_field": "message"}),
        ]
        yield manager.generate_sequences(rows, validate=True)
    finally:
        manager.shutdown()


def unpadded(batch, i: int) -> tuple[list[int], list[int], list[int]]:
    prompt_length = batch.batch["prompts"].shape[1]
    prompt = batch.batch["prompts"][i][batch.batch["attention_mask"][i, :prompt_length].bool()].tolist()
    length = int(batch.batch["attention_mask"][i, prompt_length:].sum())
    return prompt, batch.batch["responses"][i, :length].tolist(), batch.batch["response_mask"][i, :length].tolist()


@pytest.mark.parametrize("i", [0, 1], ids=["in_process", "served"])
def test_an_openenv_environment_runs_with_exact_tokens_and_its_rewards(batch, ok_model, i):
    tokenizer = AutoTokenizer.from_pretrained(ok_model)
    fields = batch.non_tensor_batch
    assert fields["failure"][i] is None and fields["end_reason"][i] == "done"
    prompt, response, mask = unpadded(batch, i)
    # the opening observation follows the row's prompt
    opening = [{"role": "user", "content": "start 1"}, {"role": "user", "content": "say ok"}]
    assert prompt == list(
        tokenizer.apply_chat_template(opening, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    runs = [(value, response[a:b]) for value, a, b in mask_runs(mask)]
    assert [value for value, _ in runs] == [1, 0, 1, 0, 1]
    assert all(tokenizer.decode(ids) == "ok<|im_end|>" for value, ids in runs if value == 1)
    observations = [observation_delta(tokenizer, [{"role": "user", "content": f"count {n}"}]) for n in (1, 2)]
    assert [ids for value, ids in runs if value == 0] == observations
    # each step's reward is the turn's; without a reward function for the row, their sum is the reward
    assert [turn.env_reward for turn in fields["turns"][i]] == [1.0, 1.0, 1.0]
    assert fields["reward_score"][i] == 3.0 and fields["reward_source"][i] == "reward_parts"


@pytest.mark.parametrize(
    ("i", "kind"),
    [(2, "RuntimeError"), (3, "timeout"), (4, "MalformedObservation")],
    ids=["raises", "hangs", "malformed"],
)
def test_a_failing_environment_ends_its_own_trajectory(batch, i, kind):
    fields = batch.non_tensor_batch
    assert fields["failure"][i] is None and fields["end_reason"][i] == "env_error"
    # the first step and its one retry (after a reset) failed, by the environment's kind of failure
    assert env_retries_by_kind(fields["turns"][i]) == {kind: 2}
    assert batch.batch["response_mask"][i].sum() > 0  # the model's turn stands


def test_a_dead_server_fails_its_sample_with_the_clients_error(batch, dead_server_url):
    fields = batch.non_tensor_batch
    assert fields["end_reason"][5] == "failed"
    assert f"Failed to connect to ws://{dead_server_url.removeprefix('http://')}/ws" in fields["failure"][5].error
    assert [fields["failure"][i] is None for i in range(5)] == [True] * 5


def test_a_server_that_dies_mid_episode_ends_the_trajectory(batch):
    fields = batch.non_tensor_batch
    assert fields["failure"][6] is None and fields["end_reason"][6] == "env_error"
    turns = fields["turns"][6]
    # the first step was answered; the second lost its connection, and the retry found no server to reset
    assert turns[0].env_reward == 1.0 and turns[0].env_retries == {}
    retries = env_retries_by_kind(turns)
    assert sum(retries.values()) == 2 and retries.get("ConnectionError") == 1, retries


def test_bad_env_kwargs_name_the_key():
    with pytest.raises(ValueError, match="exactly one of env_kwargs.environment"):
        OpenEnvEnv()
    with pytest.raises(ValueError, match="in-process needs env_kwargs.action"):
        OpenEnvEnv(environment=f"{ENVS}.CountingEnvironment")
    with pytest.raises(ValueError, match="needs env_kwargs.action_field"):
        OpenEnvEnv(base_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"env_kwargs.action='no.such.Action' cannot be imported"):
        OpenEnvEnv(environment=f"{ENVS}.CountingEnvironment", action="no.such.Action")
