"""Supervised servers and workers: a dead rollout server is replaced on its rank with the latest pushed
weights (weight pushes, sleep and wake never raise because of it), a rank that keeps dying is given up,
and a worker that dies mid-batch has its samples rerun."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from agentloop import AgentLoopManager
from tests.support.config import small_config

PROMPT = list(range(3, 30))
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def greedy(server) -> list[int]:
    return ray.get(server.generate.remote(PROMPT, GREEDY, "probe"), timeout=120).token_ids


def perturbed(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in state.items()}


def test_dead_servers_are_replaced_with_the_latest_weights_until_the_budget_is_spent(local_ray, model_path):
    import tests.support.probe_loops  # noqa: F401

    manager = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.data_parallel_size=2",
            "actor_rollout_ref.rollout.supervision.max_restarts=2",
        )
    )
    try:
        original = greedy(manager.servers[0])
        manager.update_weights(perturbed(model_path, 1))
        pushed = greedy(manager.servers[0])
        assert pushed != original

        # dies between steps: replaced before the next rollout, serving the latest push
        ray.kill(manager.servers[1])
        batch = manager.generate_sequences([{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)])
        assert len(batch) == 4 and all(count > 0 for count in batch.meta_info["rollout/requests_per_server"])
        assert [(e.rank, e.kind) for e in manager.pool.events] == [(1, "restarted")]
        assert greedy(manager.servers[1]) == pushed

        # dies before a push: the push does not raise, and the replacement gets the new weights
        ray.kill(manager.servers[1])
        manager.update_weights(perturbed(model_path, 2))
        assert greedy(manager.servers[1]) == greedy(manager.servers[0]) != pushed
        manager.sleep()
        manager.wake_up()

        # a third death within the window: given up, said so, and the rest keeps working
        ray.kill(manager.servers[1])
        manager.update_weights(perturbed(model_path, 3))
        given_up = manager.pool.events[-1]
        assert (given_up.rank, given_up.kind) == (1, "given_up") and "killed by `ray.kill`" in given_up.cause
        manager.sleep()
        manager.wake_up()
        batch = manager.generate_sequences([{"prompt": [{"role": "user", "content": "after"}]}])
        assert len(batch) == 1 and batch.meta_info["rollout/requests_per_server"] == [1, 0]
        restarts = [e.seconds for e in manager.pool.events if e.kind == "restarted"]
        assert len(restarts) == 2 and all(seconds > 0 for seconds in restarts)
        print(f"replacement servers serving again after {', '.join(f'{s:.1f}' for s in restarts)} s")
    finally:
        manager.shutdown()


@pytest.mark.parametrize("path", ["object_store", "disk"])
def test_a_server_hung_during_a_push_costs_the_push_its_health_timeout(local_ray, model_path, tmp_path, path):
    # a server stops (SIGSTOP: alive to the OS, answering nothing) as a push reaches it: the push gives it up within
    # health_timeout_s (not server_startup_timeout_s), the other server's push is not held up, and the replacement
    # serves the pushed weights under the pushed version (tests/test_weight_sync.py: the same for a collective push)
    health_timeout_s, startup_timeout_s = 5, 300
    manager = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.data_parallel_size=2",
            f"actor_rollout_ref.rollout.server_startup_timeout_s={startup_timeout_s}",
            f"actor_rollout_ref.rollout.supervision.health_timeout_s={health_timeout_s}",
        )
    )
    try:
        original, state = greedy(manager.servers[0]), perturbed(model_path, 1)
        if path == "disk":
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            model.load_state_dict({name: t for name, t in state.items() if name != "lm_head.weight"}, strict=False)
            model.save_pretrained(tmp_path)
        os.kill(ray.get(manager.servers[1].node_info.remote(), timeout=30)["pid"], signal.SIGSTOP)
        start = time.monotonic()
        if path == "disk":
            manager.update_weights_from_disk(str(tmp_path), version=7)
        else:
            manager.update_weights(state, version=7)
        elapsed = time.monotonic() - start
        [event] = manager.pool.events
        assert (event.rank, event.kind) == (1, "restarted")
        assert "supervision.health_timeout_s" in event.cause and "update_weights" in event.cause
        # given up within about health_timeout_s (probes tick each second); the rest is starting the replacement
        assert elapsed - event.seconds < health_timeout_s + 5, (elapsed, event.seconds)
        outputs = [ray.get(s.generate.remote(PROMPT, GREEDY, "probe"), timeout=120) for s in manager.servers]
        assert outputs[0].token_ids == outputs[1].token_ids != original
        assert [output.policy_version for output in outputs] == [7, 7]
        print(
            f"{path} push with a stopped server: {elapsed:.1f} s, {event.seconds:.1f} s of it starting its replacement"
        )
    finally:
        manager.shutdown()


def test_a_worker_that_dies_mid_batch_has_its_samples_rerun(local_ray, tmp_path):
    import tests.support.probe_loops  # noqa: F401

    manager = AgentLoopManager(small_config("actor_rollout_ref.rollout.agent.num_workers=2"))
    try:
        marker = tmp_path / "worker_exited"
        rows = [
            {
                "prompt": [{"role": "user", "content": f"q{i}"}],
                "agent_name": "probe_exits_once",
                "extra_info": {"index": i, "exit_marker": str(marker) if i == 3 else None},
            }
            for i in range(4)
        ]
        batch = manager.generate_sequences(rows)
        assert marker.exists() and manager.workers.restarts == 1
        assert len(batch) == 4 and sorted(batch.non_tensor_batch["index"]) == [0, 1, 2, 3]
        assert all(batch.batch["response_mask"][i].sum() > 0 for i in range(4))
        assert len(manager.generate_sequences(rows)) == 4  # the replacement keeps serving
    finally:
        manager.shutdown()


def test_a_hung_server_costs_the_rollout_its_health_timeout_not_the_request_timeout(local_ray, tmp_path):
    # mid-rollout, one sample stops its server's process (SIGSTOP: a wedged engine); the routers' probes find it
    # within health_timeout_s, its waiting turns run again on the other server, and it is replaced after the batch
    import tests.support.probe_loops  # noqa: F401  (probe_chaos)

    health_timeout_s, request_timeout_s = 10, 600
    manager = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.data_parallel_size=2",
            f"actor_rollout_ref.rollout.request_timeout_s={request_timeout_s}",
            f"actor_rollout_ref.rollout.supervision.health_timeout_s={health_timeout_s}",
        )
    )
    try:
        rows = [
            {
                "prompt": [{"role": "user", "content": f"question {i}"}],
                "agent_name": "probe_chaos",
                "extra_info": {
                    "index": i,
                    "chaos": "stop" if i == 0 else None,
                    "chaos_marker": str(tmp_path / "stopped"),
                },
            }
            for i in range(6)
        ]
        start = time.monotonic()
        batch = manager.generate_sequences(rows)
        elapsed = time.monotonic() - start
        assert (tmp_path / "stopped").exists() and len(batch) == 6
        assert all(batch.batch["attention_mask"][i, -24:].sum() > 0 for i in range(6))
        assert batch.meta_info["rollout/rehomed_requests"] >= 1 and batch.meta_info["rollout/failed_samples"] == 0
        [event] = manager.pool.events
        assert event.kind == "restarted" and "found dead or hung by the routers" in event.cause
        # bounded by the probes, not by request_timeout_s (which the turns waiting on the stopped server would wait out)
        assert elapsed < request_timeout_s / 4
        print(
            f"rollout with a stopped server: {elapsed:.1f} s (health_timeout_s={health_timeout_s}, "
            f"replacement serving after {event.seconds:.1f} s)"
        )
        again = manager.generate_sequences(rows[1:])
        assert all(count > 0 for count in again.meta_info["rollout/requests_per_server"])
    finally:
        manager.shutdown()


def test_the_only_server_dying_mid_rollout_costs_its_turns_the_replacement_not_their_samples(
    local_ray, model_path, tmp_path
):
    # one server, killed by a sample between its two turns: the turns wait for the replacement the manager starts
    # while it waits on the rollout (the routers have no other server to re-home them to), and every sample ends.
    # The agent loops run in this process here (the replacement reaches their router across threads); in worker
    # actors in test_streaming's case
    import tests.support.probe_loops  # noqa: F401  (probe_chaos)

    manager = AgentLoopManager(small_config())
    try:
        manager.update_weights(perturbed(model_path, 1), version=1)
        pushed = greedy(manager.servers[0])
        rows = [
            {
                "prompt": [{"role": "user", "content": f"question {i}"}],
                "agent_name": "probe_chaos",
                "extra_info": {"index": i, "chaos": "server" if i == 0 else None, "chaos_marker": str(tmp_path / "k")},
            }
            for i in range(4)
        ]
        batch = manager.generate_sequences(rows)
        assert (tmp_path / "k").exists() and len(batch) == 4
        assert batch.meta_info["rollout/failed_samples"] == 0 and batch.meta_info["rollout/rehomed_requests"] >= 1
        [event] = manager.pool.events
        assert event.kind == "restarted" and "died during a rollout" in event.cause
        assert greedy(manager.servers[0]) == pushed  # the replacement serves the latest push
    finally:
        manager.shutdown()
