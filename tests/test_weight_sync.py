"""Weight paths (``rollout.weight_sync``): a collective push (one torch.distributed group of the source and every
server, gloo here, bucketed broadcasts) leaves every server serving the pushed policy under its version, survives a
server lost before or during it (the replacement gets the weights in a group of its own), and a bad configuration
fails within ``weight_sync_timeout_s`` naming the server and the setting."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from agentloop import AgentLoopManager
from agentloop.server.collective import WeightGroup, WeightReceiver, WeightSource, bucket_plan
from tests.support.config import small_config
from trainer.fsdp_workers import FSDPWorker, push_weights, start_workers
from trainer.settings import rank_settings
from tests.test_supervision import GREEDY, PROMPT, perturbed

# small buckets: the tiny model's weights go in many broadcasts, some tensors alone in theirs
BUCKET_MB = 0.05


@ray.remote(num_cpus=0)
class Source(WeightSource):
    """The trainer rank's part of a collective push, with weights given to it (the trainer's rank 0 keeps its
    gathered policy the same way, ``FSDPWorker.keep_for_push``)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.keep_weights(state)


def hf_greedy(model_path: str, state: dict[str, torch.Tensor]) -> list[int]:
    """The policy's own greedy tokens: transformers' ``generate`` on a model holding ``state`` (the tiny model ties
    its output head to its embeddings: the servers keep that tie, and so does this model)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict({name: tensor for name, tensor in state.items() if name != "lm_head.weight"}, strict=False)
    ids = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=GREEDY["max_new_tokens"])
    return ids[0, len(PROMPT) :].tolist()


def served(manager: AgentLoopManager) -> list[tuple[list[int], int]]:
    outputs = [ray.get(s.generate.remote(PROMPT, GREEDY, "probe"), timeout=120) for s in manager.servers]
    return [(output.token_ids, output.policy_version) for output in outputs]


def collective_config(*overrides: str):
    return small_config(
        "actor_rollout_ref.rollout.data_parallel_size=2",
        "actor_rollout_ref.rollout.weight_sync=collective",
        f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={BUCKET_MB}",
        *overrides,
    )


def test_a_collective_push_serves_the_pushed_policy_and_reaches_replacements(local_ray, model_path):
    manager = AgentLoopManager(collective_config("actor_rollout_ref.rollout.weight_sync_timeout_s=30"))
    try:
        state = perturbed(model_path, 1)
        original = served(manager)[0][0]
        expected = hf_greedy(model_path, state)
        assert expected != original
        source = Source.remote(state)
        manager.update_weights_collective(source, version=3)
        assert served(manager) == [(expected, 3), (expected, 3)]

        # a server lost before a push: replaced, and sent the weights in a group of its own
        state = perturbed(model_path, 2)
        source = Source.remote(state)
        ray.kill(manager.servers[1])
        manager.update_weights_collective(source, version=4)
        assert [(e.rank, e.kind) for e in manager.pool.events] == [(1, "restarted")]
        expected = hf_greedy(model_path, state)
        assert served(manager) == [(expected, 4), (expected, 4)]

        # lost between pushes: replaced at the next rollout, with the latest weights from the source
        ray.kill(manager.servers[0])
        batch = manager.generate_sequences([{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(2)])
        assert len(batch) == 2 and [(e.rank, e.kind) for e in manager.pool.events][-1] == (0, "restarted")
        assert served(manager) == [(expected, 4), (expected, 4)]
    finally:
        manager.shutdown()


def test_a_server_hung_during_a_collective_push_is_replaced_within_its_health_timeout(local_ray, model_path):
    # server 1 stops (SIGSTOP) as the push begins: found hung within health_timeout_s, the push is called off (server
    # 0 would wait for it until weight_sync_timeout_s), server 0 gets the weights in a group without it, and the
    # replacement in one of its own
    health_timeout_s, sync_timeout_s = 5, 120
    manager = AgentLoopManager(
        collective_config(
            f"actor_rollout_ref.rollout.supervision.health_timeout_s={health_timeout_s}",
            f"actor_rollout_ref.rollout.weight_sync_timeout_s={sync_timeout_s}",
        )
    )
    try:
        state = perturbed(model_path, 1)
        source = Source.remote(state)
        ray.get(source.__ray_ready__.remote(), timeout=60)
        os.kill(ray.get(manager.servers[1].node_info.remote(), timeout=30)["pid"], signal.SIGSTOP)
        start = time.monotonic()
        manager.update_weights_collective(source, version=2)
        elapsed = time.monotonic() - start
        [event] = manager.pool.events
        assert (event.rank, event.kind) == (1, "restarted") and "supervision.health_timeout_s" in event.cause
        assert elapsed - event.seconds < health_timeout_s + 10, (elapsed, event.seconds)
        expected = hf_greedy(model_path, state)
        assert served(manager) == [(expected, 2), (expected, 2)]
        print(f"collective push with a stopped server: {elapsed:.1f} s, {event.seconds:.1f} s of it replacing it")
    finally:
        manager.shutdown()


def test_an_unreachable_address_fails_within_its_timeout_naming_the_server_and_setting(local_ray, model_path):
    timeout_s = 3
    manager = AgentLoopManager(
        collective_config(
            "actor_rollout_ref.rollout.weight_sync_master_addr=203.0.113.1",  # TEST-NET-3: routed nowhere
            f"actor_rollout_ref.rollout.weight_sync_timeout_s={timeout_s}",
        )
    )
    try:
        source = Source.remote(perturbed(model_path, 1))
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failure:
            manager.update_weights_collective(source, version=1)
        elapsed = time.monotonic() - start
        message = str(failure.value)
        assert "rollout server 0" in message and "rollout server 1" in message
        assert "weight_sync_timeout_s" in message and "weight_sync_master_addr" in message and "203.0.113.1" in message
        assert elapsed < 4 * timeout_s + 10, elapsed  # the store's connect retries once past its timeout
        assert manager.pool.events == []  # a configuration error replaces no server
    finally:
        manager.shutdown()


def test_a_server_that_never_joins_fails_the_source_within_its_timeout_naming_it():
    # in one process: the source and server 0 join, server 1 never does
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    source = WeightSource()
    source.keep_weights(state)
    address, port = source.open_weight_group(0, 3)
    group = WeightGroup("127.0.0.1", port, (0, 1), 1 << 20, timeout_s=3)
    joined_error: list[BaseException] = []

    def server_0() -> None:
        try:
            WeightReceiver(group, 0).join()
        except RuntimeError as error:
            joined_error.append(error)

    thread = threading.Thread(target=server_0)
    thread.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout server 1 did not join .*weight_sync_timeout_s=3"):
        source.broadcast_weights(group)
    thread.join(timeout=30)
    assert time.monotonic() - start < 15 and not thread.is_alive()
    assert joined_error and "rollout server 0: trainer rank 0 did not start the push within" in str(joined_error[0])


def test_buckets_keep_every_dtype_and_shape():
    state = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7, dtype=torch.float64),
        "c": torch.randn(2, 3).to(torch.bfloat16),
        "d": torch.arange(5, dtype=torch.int64),
    }
    source = WeightSource()
    source.keep_weights(state)
    _, port = source.open_weight_group(0, 10)
    group = WeightGroup("127.0.0.1", port, (0,), bucket_bytes=64, timeout_s=10)
    manifest = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]
    assert len(bucket_plan(manifest, group.bucket_bytes)) == 3  # a fits alone; b alone (56 B + a's 64 > 64); c, d
    received: dict[str, torch.Tensor] = {}

    def server() -> None:
        receiver = WeightReceiver(group, 0)
        receiver.join()
        for bucket in receiver.buckets():
            received.update({name: tensor.clone() for name, tensor in bucket.items()})

    thread = threading.Thread(target=server)
    thread.start()
    sent = source.broadcast_weights(group)
    thread.join(timeout=30)
    assert sent > 0 and received.keys() == state.keys()
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


@ray.remote
class ScalableRank(FSDPWorker.__ray_actor_class__):  # the trainer's rank as is, plus a way to change its policy
    def scale_policy(self, factor: float) -> None:
        with torch.no_grad():
            for parameter in self.policy.model.parameters():
                parameter.mul_(factor)


def test_the_trainer_pushes_its_policy_on_every_path(local_ray, model_path, tmp_path):
    # trainer.fsdp_workers.push_weights from a real FSDP rank: after each push both servers serve the rank's policy
    manager = AgentLoopManager(
        collective_config(
            "actor_rollout_ref.rollout.weight_sync_timeout_s=60",
            f"actor_rollout_ref.rollout.weight_sync_dir={tmp_path}",
        )
    )
    ranks = start_workers(rank_settings(manager.config), 1, 1, 300, worker_class=ScalableRank)
    try:
        for version, path in enumerate(["collective", "disk", "object_store"], start=1):
            ray.get(ranks[0].scale_policy.remote(1.0 + 0.2 * version), timeout=60)
            state = ray.get(ranks[0].full_state_dict.remote(), timeout=60)
            push_weights(ranks, manager, 300, version, path=path)
            expected = hf_greedy(model_path, state)
            assert served(manager) == [(expected, version), (expected, version)], path
    finally:
        ray.get([rank.shutdown.remote() for rank in ranks], timeout=60)
        for rank in ranks:
            ray.kill(rank)
        manager.shutdown()
    # the last disk push is gone with the ranks (weight_sync_dir is a RAM disk by default)
    assert not list(tmp_path.glob("agentloop-push-*"))
