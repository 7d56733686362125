"""The rollout stream on real Ray, workers and the hf engine: GRPO groups start as far ahead as the staleness
bound allows and no further, come out as soon as they finish (a slow one is overtaken) or, in submission order,
batch by batch as their rows came, and a group that finished too late for the batch taking it is regenerated under
the current policy, never handed out."""

from __future__ import annotations

import time

import pytest
import ray
from transformers import AutoModelForCausalLM

import agentloop.testing  # noqa: F401  (registers fixed_length)
from agentloop import AgentLoopManager
from agentloop.streaming import oldest_versions
from tests.support.config import small_config

SLOW = (0, 0)  # step 0's first row waits this long before generating
SLOW_S = 3.0


def row(step: int, position: int) -> dict:
    delay = SLOW_S if (step, position) == SLOW else 0.0
    return {
        "prompt": [{"role": "user", "content": f"step {step} row {position}"}],
        "agent_name": "fixed_length",
        "extra_info": {"length": 4, "delay_s": delay, "index": f"{step}.{position}"},
    }


def groups_of(batch) -> list[tuple[str, int, int]]:
    """(row, the version its group started at, its oldest token's version) per group, checking that a group's
    two samples are contiguous and share the row and the start."""
    uids, rows, versions = (batch.non_tensor_batch[key] for key in ("uid", "index", "policy_version"))
    oldest = oldest_versions(batch)
    groups = []
    for start in range(0, len(batch), 2):
        assert (
            len({uids[start], uids[start + 1]}) == 1
            and rows[start] == rows[start + 1]
            and versions[start] == versions[start + 1]
        )
        groups.append((rows[start], int(versions[start]), int(oldest[start : start + 2].min())))
    return groups


@pytest.fixture(scope="module")
def manager(local_ray):
    manager = AgentLoopManager(
        small_config("actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.agent.num_workers=2")
    )
    yield manager
    manager.shutdown()


def test_the_stream_runs_ahead_within_the_bound_and_regenerates_late_groups(manager, model_path):
    pulled: list[int] = []

    def steps():
        for step in range(4):
            pulled.append(step)
            yield [row(step, 0), row(step, 1)]

    stream = manager.stream(steps(), groups_per_batch=2, max_staleness=1, capacity=4, version=0)
    try:
        # step 1 trains version 0: the first two groups to finish, the slow one overtaken
        first = groups_of(stream.take(min_version=-1, timeout_s=60))
        assert (
            len(first) == 2
            and "0.0" not in {name for name, _, _ in first}
            and {v for _, start, oldest in first for v in (start, oldest)} == {0}
        )
        time.sleep(0.5)
        assert pulled == [0, 1]  # version 0 admits the stream's steps 0 and 1 (max_staleness=1), not step 2

        weights = AutoModelForCausalLM.from_pretrained(model_path).state_dict()
        for version in (1, 2):  # the trainer pushed twice: version 0's two unclaimed groups are now too old
            manager.update_weights(weights, version=version)
            stream.set_version(version)
        taken = [*first]
        regenerated = 0
        for _ in range(3):
            batch = stream.take(min_version=1, timeout_s=60)
            regenerated += batch.meta_info["async/regenerated_groups"]
            assert batch.meta_info["supervision/worker_restarts"] == 0
            groups = groups_of(batch)
            assert all(oldest >= 1 for _, _, oldest in groups)  # no token older than the bound
            taken += groups
        assert pulled == [0, 1, 2, 3]
        assert sorted(name for name, _, _ in taken) == sorted(
            f"{step}.{i}" for step in range(4) for i in range(2)
        )  # each row once
        # the third quick group of version 0 (and the slow one, had it generated before the pushes) came back
        # regenerated: started again at version 2. The slow one's tokens are of version 2 either way.
        again = [name for name, start, _ in taken[2:] if name[0] in "01" and start == 2]
        assert regenerated == len(again) >= 1 and dict((name, oldest) for name, _, oldest in taken)["0.0"] == 2
        stream.set_version(3)  # admits a fifth step, which the rows do not have
        with pytest.raises(RuntimeError, match="the rows ran out"):
            stream.take(min_version=1, timeout_s=10)
        with stream.drained(timeout_s=10):
            busy, start = manager.pool.busy_s(), time.perf_counter()
            time.sleep(0.5)
            # nothing in flight: the server counted none of that time as busy
            assert manager.pool.busy_s()[0] == pytest.approx(busy[0], abs=0.05) and busy[0] > 0
            assert manager.pool.idle_share_since(busy, start) > 0.9
    finally:
        stream.stop()


def test_in_submission_order_a_batch_takes_its_own_rows_and_waits_for_a_slow_one(manager):
    stream = manager.stream(
        iter([[row(step, 0), row(step, 1)] for step in range(2)]),
        groups_per_batch=2,
        max_staleness=1,
        capacity=4,
        version=0,
        order="submitted",
    )
    try:
        with pytest.raises(TimeoutError, match=r"finished, 0 of them next in submitted order"):
            stream.take(min_version=0, timeout_s=1)  # 0.0 is still waiting out its delay
        first = stream.take(min_version=0, timeout_s=60)  # the timeout lost nothing
        assert [name for name, _, _ in groups_of(first)] == ["0.0", "0.1"]
        # step 1's groups finished while 0.0 waited out its delay: buffered for the next batch, not handed out first
        assert first.meta_info["async/buffered_groups"] == 2
        assert [name for name, _, _ in groups_of(stream.take(min_version=0, timeout_s=60))] == ["1.0", "1.1"]
    finally:
        stream.stop()


def test_groups_the_keep_check_refuses_are_dropped_and_replaced(manager, caplog):
    """Dynamic sampling's side of the stream: a refused group gives its place among the steps' groups to a new one (else
    the staleness gate, counting it, would hold back the group that completes the batch), and once ``max_dropped``
    groups were dropped while a batch waits, ``take`` returns the kept groups there are."""
    stream = manager.stream(
        iter([[row(step, 0), row(step, 1)] for step in range(3)]),
        groups_per_batch=2,
        max_staleness=0,
        capacity=4,
        version=0,
        keep=lambda group: not str(group.non_tensor_batch["index"][0]).endswith(".1"),
        max_dropped=2,
    )
    try:
        # version 0 admits step 0's two groups only; 0.1 is dropped, and 1.0 takes its place while 0.0 waits out its delay
        batch = stream.take(min_version=0, timeout_s=60)
        assert sorted(name for name, _, _ in groups_of(batch)) == ["0.0", "1.0"]
        assert (
            batch.meta_info["dynamic_sampling/dropped_groups"],
            batch.meta_info["dynamic_sampling/finished_groups"],
        ) == (1, 3)
        stream.set_version(1)  # admits step 1's second group (no weights pushed: the tokens stay of version 0)
        # 1.1 and 2.1 are dropped too: the limit, with 2.0 alone kept
        batch = stream.take(min_version=0, timeout_s=60)
        assert [name for name, _, _ in groups_of(batch)] == ["2.0"] and batch.meta_info[
            "dynamic_sampling/dropped_groups"
        ] == 2
        assert "dynamic sampling dropped 2 groups while a batch waited" in caplog.text
        assert stream.untrained_rows() == (3, []), "dropped rows are not replayed after a resume"
    finally:
        stream.stop()


def test_a_worker_that_dies_mid_stream_is_replaced_and_its_groups_run_again(manager):
    restarts = manager.workers.restarts
    stream = manager.stream(iter([[row(0, 0), row(0, 1)]]), groups_per_batch=2, max_staleness=0, capacity=2, version=0)
    try:
        time.sleep(1.0)  # the slow group (the first, on worker 0) is waiting out its delay
        ray.kill(manager.workers.handles[0])
        batch = stream.take(min_version=0, timeout_s=120)
        assert sorted(name for name, _, _ in groups_of(batch)) == ["0.0", "0.1"]  # the lost group ran again, once
        assert batch.meta_info["supervision/worker_restarts"] == restarts + 1
    finally:
        stream.stop()


def test_the_only_server_dying_mid_stream_is_replaced_while_a_batch_waits_and_no_group_fails(manager, tmp_path):
    import tests.support.probe_loops  # noqa: F401  (probe_chaos)

    rows = [
        {
            "prompt": [{"role": "user", "content": f"chaos {i}"}],
            "agent_name": "probe_chaos",
            "extra_info": {"index": i, "chaos": "server" if i == 0 else None, "chaos_marker": str(tmp_path / "k")},
        }
        for i in range(2)
    ]
    restarts = len(manager.pool.events)
    stream = manager.stream(iter([rows]), groups_per_batch=2, max_staleness=0, capacity=2, version=0)
    try:
        batch = stream.take(min_version=0, timeout_s=120)
        assert (tmp_path / "k").exists() and len(batch) == 4 and batch.meta_info["rollout/failed_samples"] == 0
        assert [event.kind for event in manager.pool.events[restarts:]] == ["restarted"]
    finally:
        stream.stop()


def test_a_group_that_kills_its_worker_every_time_fails_the_stream_with_the_cause(manager, monkeypatch):
    import tests.support.probe_loops  # noqa: F401  (probe_exits_once)

    monkeypatch.setattr(
        "agentloop.streaming.MAX_GROUP_RESTARTS", 1
    )  # the stream runs in this process; each restart costs seconds
    crashing = {
        "prompt": [{"role": "user", "content": "crash"}],
        "agent_name": "probe_exits_once",
        "extra_info": {"always_exit": True},
    }
    stream = manager.stream(iter([[crashing]]), groups_per_batch=1, max_staleness=0, capacity=1, version=0)
    try:
        with pytest.raises(RuntimeError, match=r"died 2 times: something in its samples kills the worker process"):
            stream.take(min_version=0, timeout_s=120)
    finally:
        stream.stop()
