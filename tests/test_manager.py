"""The full stack on a real local Ray: manager -> workers -> loops -> router -> servers -> hf engine."""

import asyncio
import threading
import time
import uuid

import pytest
import ray
import torch

import agentloop.testing  # noqa: F401  (registers fixed_length)
import tests.support.probe_loops  # noqa: F401  (registers probe_multi_turn, probe_ordered_turn, probe_edits_row)
from agentloop import AgentLoopManager
from agentloop.router import Router
from tests.support.config import small_config

pytestmark = pytest.mark.usefixtures("local_ray")


def rows(texts, **fields):
    return [{"prompt": [{"role": "user", "content": text}], **fields} for text in texts]


@pytest.fixture(scope="module")
def manager(local_ray, tmp_path_factory):
    loops = tmp_path_factory.mktemp("loops") / "loops.yaml"
    loops.write_text("- name: yaml_single_turn\n  _target_: agentloop.agent_loop.single_turn.SingleTurnAgentLoop\n")
    manager = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.data_parallel_size=2",
            "actor_rollout_ref.rollout.n=2",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        )
    )
    yield manager
    manager.shutdown()
    # the agent loops ran on an event-loop thread of this process (tests' agent.num_workers=0): shut down, it is gone
    assert not [thread for thread in threading.enumerate() if thread.name == "agent-loop-worker"]


def test_in_driver_agent_loops_edit_copies_of_the_rows(manager):
    assert [thread for thread in threading.enumerate() if thread.name == "agent-loop-worker"]
    given = [
        {"prompt": [{"role": "user", "content": "hi"}], "agent_name": "probe_edits_row", "extra_info": {"index": 0}}
    ]
    batch = manager.generate_sequences(given)
    # each sample's loop edited its own copy (the batch shows it), not the caller's row, as in a worker process
    assert all(extra["edited"] for extra in batch.non_tensor_batch["extra_info"])
    assert given == [
        {"prompt": [{"role": "user", "content": "hi"}], "agent_name": "probe_edits_row", "extra_info": {"index": 0}}
    ]


def test_a_negative_worker_count_is_named_before_any_server_starts(local_ray):
    with pytest.raises(
        ValueError, match=r"agent.num_workers=-1: it counts agent-loop worker processes; set it >= 1, or 0"
    ):
        AgentLoopManager(small_config("actor_rollout_ref.rollout.agent.num_workers=-1"))


def test_batch_shapes_groups_and_fields(manager):
    batch = manager.generate_sequences(
        [
            {
                "prompt": [{"role": "user", "content": text}],
                "data_source": "unit",
                "extra_info": {"k": 1, "index": 10 + i},
            }
            for i, text in enumerate(["What is 1 + 1?", "Hello there, how are you today?", "x"])
        ]
    )
    assert len(batch) == 6
    assert batch.batch["prompts"].shape == (6, 96) and batch.batch["responses"].shape == (6, 24)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert batch.batch[key].shape == (6, 120)
    nt = batch.non_tensor_batch
    assert list(nt["index"]) == [10, 10, 11, 11, 12, 12]  # the dataset index, extra_info.index
    assert nt["uid"][0] == nt["uid"][1] != nt["uid"][2]
    assert len(set(nt["request_id"])) == 6
    assert set(nt["agent_name"]) == {"single_turn_agent"} and set(nt["data_source"]) == {"unit"}
    assert [extra["k"] for extra in nt["extra_info"]] == [1] * 6
    # every real response token is a model token with a finite, negative logprob
    attention = batch.batch["attention_mask"][:, 96:]
    assert torch.equal(batch.batch["response_mask"], attention)
    assert (batch.batch["rollout_log_probs"][attention.bool()] < 0).all()
    meta = batch.meta_info
    assert sum(meta["rollout/requests_per_server"]) == 6
    spread = [meta[f"timing_s/agent_loop/generate_sequences/{key}"] for key in ("min", "mean", "max")]
    assert spread == sorted(spread) and spread[0] > 0


def test_turns_ready_together_share_a_call_and_fail_alone(manager):
    # seven first turns made in one pass of the event loop: one Ray call per server, each answer exact, and
    # the one bad prompt among them fails alone with its own message
    router = Router(manager.servers)
    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    prompts = [[5, 6, 7 + i] for i in range(6)] + [[10**6]]

    async def burst():
        return await asyncio.gather(
            *(router.generate(f"burst-{i}", p, greedy) for i, p in enumerate(prompts)), return_exceptions=True
        )

    *outputs, bad = asyncio.run(burst())
    # the same error a lone call raises: the request's own type, with the server's traceback
    assert (
        isinstance(bad, ValueError)
        and isinstance(bad, ray.exceptions.RayTaskError)
        and "outside the vocabulary" in str(bad)
    )
    assert "validate_prompt" in str(bad)
    alone = [
        ray.get(manager.servers[0].generate.remote(p, greedy, f"alone-{i}"), timeout=60)
        for i, p in enumerate(prompts[:6])
    ]
    assert [output.token_ids for output in outputs] == [output.token_ids for output in alone]
    assert all(
        len(output.token_ids) == len(output.log_probs) == 4 and output.finish_reason == "length" for output in outputs
    )
    stats = router.take_stats()
    assert stats.requests_per_server == [4, 3] and stats.server_calls == 2 and stats.requests_per_call == 3.5

    # a call Ray refuses (an argument it cannot serialize) fails at once, not after request_timeout_s
    unsendable = {**greedy, "stop_token_ids": [threading.Lock()]}
    with pytest.raises(TypeError, match="pickle"):
        asyncio.run(asyncio.wait_for(router.generate("unsendable", [5, 6], unsendable), timeout=30))


def test_a_samples_token_versions_are_its_own_sessions_and_not_a_side_call(manager):
    # a loop's tokens are stamped with the weights that sampled them: its own session's when it generates under
    # its row's id (a side call under another id, a judge's, is not its), else its sessions' in the order begun
    router = Router(manager.servers)
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    state = _load_state(manager)

    async def run():
        with router.running_sample("row-a"):
            await router.generate("judge-of-a", [5, 6, 7], params)
        with router.running_sample("row-b"):
            await router.generate("b-first", [5, 6, 8], params)
        await asyncio.to_thread(manager.update_weights, state, version=41)
        with router.running_sample("row-a"):
            await router.generate("row-a", [5, 6, 9], params)
        with router.running_sample("row-b"):
            await router.generate("b-second", [5, 6, 10], params)
        return router.take_versions("row-a"), router.take_versions("row-b")

    manager.update_weights(state, version=40)
    versions_a, versions_b = asyncio.run(run())
    assert versions_a == [41] * 3
    assert versions_b == [40] * 3 + [41] * 3
    assert router.take_versions("judge-of-a") == []  # forgotten with its sample


@ray.remote
class HungServer:
    """A rollout server that never answers (a wedged engine), recording the aborts it is sent."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.received = 0

    async def generate(self, prompt_ids, sampling_params, request_id, images=None):
        self.received += 1
        await asyncio.Event().wait()

    async def generate_many(self, requests):
        self.received += len(requests)
        await asyncio.Event().wait()
        yield []

    def received_requests(self) -> int:
        return self.received

    def abort(self, request_id: str) -> int:
        self.aborted.append(request_id)
        return 1

    def aborted_ids(self) -> list[str]:
        return self.aborted


def test_a_hung_server_times_out_each_request_aborts_it_and_leaves_no_task_behind(local_ray):
    hung = HungServer.remote()
    router = Router([hung], request_timeout_s=1.0)
    params = {"max_new_tokens": 4}

    async def run():
        before = asyncio.all_tasks()
        lone = await asyncio.gather(router.generate("lone", [5, 6], params), return_exceptions=True)
        burst = await asyncio.gather(
            *(router.generate(f"burst-{i}", [5, 6], params) for i in range(3)), return_exceptions=True
        )
        await asyncio.sleep(0.2)  # the answering tasks' cancellation runs
        return lone + burst, asyncio.all_tasks() - before

    errors, left = asyncio.run(asyncio.wait_for(run(), timeout=60))
    deadline = time.monotonic() + 30  # the aborts are sent as the requests time out: they may still be on their way
    while len(aborted := ray.get(hung.aborted_ids.remote(), timeout=30)) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    ray.kill(hung)
    assert all(isinstance(error, TimeoutError) and "request_timeout_s" in str(error) for error in errors), errors
    assert router.take_stats().server_calls == 2  # the lone call and the burst's one
    assert not left, f"tasks still waiting on the hung server: {left}"
    assert sorted(aborted) == ["burst-0", "burst-1", "burst-2", "lone"]


def test_a_replacement_server_stays_live_with_a_true_count_when_its_predecessors_requests_fail(manager):
    # the requests in flight on a server fail (its actor is killed) only after the server was replaced: they
    # must neither mark the replacement dead nor lower its count, and they are re-homed onto it
    doomed = HungServer.remote()
    router = Router([doomed], request_timeout_s=120)
    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    async def run():
        turns = [asyncio.ensure_future(router.generate(f"race-{i}", [5, 6, 7 + i], greedy)) for i in range(3)]
        while await doomed.received_requests.remote() < 3:
            await asyncio.sleep(0.05)
        router.replace(0, manager.servers[0])
        ray.kill(doomed)
        outputs = await asyncio.gather(*turns)
        return (
            outputs,
            [slot.in_flight for slot in router.placement.slots],
            [slot.alive for slot in router.placement.slots],
        )

    outputs, in_flight, alive = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert [len(output.token_ids) for output in outputs] == [4, 4, 4]
    assert alive == [True] and in_flight == [0]
    stats = router.take_stats()
    assert stats.rehomed_requests == 3 and stats.requests_per_server == [6] and stats.unhealthy_ranks == []


def test_prompts_render_through_the_chat_template(manager, model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    batch = manager.generate_sequences(rows(["What is 1 + 1?"]))
    prompt = batch.batch["prompts"][0][batch.batch["attention_mask"][0, :96].bool()]
    assert tokenizer.decode(prompt) == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"


def test_registry_by_decorator_and_yaml_and_unknown_name(manager):
    batch = manager.generate_sequences(
        rows(["a"], agent_name="yaml_single_turn") + rows(["b"], agent_name="probe_multi_turn")
    )
    assert list(batch.non_tensor_batch["agent_name"]) == ["yaml_single_turn"] * 2 + ["probe_multi_turn"] * 2
    with pytest.raises(
        KeyError, match=r"unknown agent_name \['nope'\]; registered agent loops: .*'fixed_length'"
    ) as error:
        manager.generate_sequences(rows(["a"]) + rows(["b"], agent_name="nope"))
    # rejected here before any generation, not by a worker (a worker's error would come back as a RayTaskError)
    assert type(error.value) is KeyError


def test_multi_turn_mask_and_sticky_sessions(manager):
    batch = manager.generate_sequences(
        rows([f"question {i}: " + "tell me more " * 6 for i in range(4)], agent_name="probe_multi_turn")
    )
    for i in range(len(batch)):
        extra = batch.non_tensor_batch["extra_fields"][i]
        assert len(set(extra["servers"])) == 1, "a session must stay on its server"
        assert all(hits > 0 for hits in extra["cached"][1:]), "later turns reuse the session's prefix cache"
        observation = extra["observation"]
        mask = batch.batch["response_mask"][i].tolist()
        assert mask[:4] == [1] * 4 and mask[4 : 4 + len(observation)] == [0] * len(observation)
        start = 4 + len(observation)
        assert batch.batch["responses"][i, 4:start].tolist() == observation
        assert mask[start : start + 4] == [1] * 4
    assert batch.meta_info["rollout/cached_token_share"] > 0


def test_validation_is_greedy_and_weights_and_sleep_reach_every_server(manager):
    prompts = rows(["same prompt"] * 4)
    first = manager.generate_sequences(prompts, validate=True)
    assert len(first) == 4  # val_kwargs.n = 1
    assert all(torch.equal(first.batch["responses"][0], first.batch["responses"][i]) for i in range(4))
    assert set(first.meta_info["rollout/requests_per_server"]) != {0}

    model_state = _load_state(manager)
    torch.manual_seed(3)
    manager.update_weights({name: t + 0.5 * torch.randn_like(t) for name, t in model_state.items()})
    changed = manager.generate_sequences(prompts, validate=True)
    assert not torch.equal(changed.batch["responses"][0], first.batch["responses"][0])
    assert all(torch.equal(changed.batch["responses"][0], changed.batch["responses"][i]) for i in range(4))

    manager.sleep()
    manager.wake_up()
    manager.update_weights(model_state)
    restored = manager.generate_sequences(prompts, validate=True)
    assert torch.equal(restored.batch["responses"], first.batch["responses"])


def _load_state(manager):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(manager.config.actor_rollout_ref.model.path).state_dict()


@pytest.mark.parametrize("own_request_id", [False, True], ids=["row_request_id", "verl_style_own_request_id"])
def test_a_grpo_group_shares_a_server_and_groups_spread(manager, own_request_id):
    # group affinity (rollout.agent.group_affinity_slack, 8 by default): a group's samples share their
    # prompt, so they go where its first one went while the balance allows; different groups still spread.
    # Also for loops that generate under request ids of their own, as verl's do.
    prompts = [f"shared prompt {i} " * 8 for i in range(8)]
    batch = manager.generate_sequences(
        rows(prompts, agent_name="fixed_length", extra_info={"length": 2, "own_request_id": own_request_id})
    )
    fields = batch.non_tensor_batch
    servers: dict[str, set[int]] = {}
    for uid, extra in zip(fields["uid"], fields["extra_fields"]):
        servers.setdefault(uid, set()).add(extra["server"])
    assert len(servers) == 8 and all(len(used) == 1 for used in servers.values()), servers
    assert set().union(*servers.values()) == {0, 1}


def test_overlong_prompt_error_and_truncation(manager):
    long_text = "word " * 200
    # the sample fails alone; one of one is over rollout.max_failed_sample_ratio, so the call fails with its traceback
    with pytest.raises(RuntimeError, match="raise the limit .* or set data.truncation=left"):
        manager.generate_sequences(rows([long_text]))


@pytest.fixture(scope="module")
def one_router_manager(local_ray):
    """Two servers behind a single worker (so a single router sees all traffic), n = 1."""
    manager = AgentLoopManager(
        small_config(
            "actor_rollout_ref.rollout.data_parallel_size=2",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "data.max_response_length=300",
        )
    )
    yield manager
    manager.shutdown()


def test_router_balances_mixed_lengths(one_router_manager):
    # Alternating long and short requests, each long one arriving once the short one before it has finished, each
    # short one once the long one before it is in flight (an order, not delays a busy machine could stretch): a
    # counter that never went down would degrade to round-robin and pile every long request on one server. The
    # tokens each server generated judge the balance, not the router's in-flight counts.
    lengths = [64 if i % 2 == 0 else 2 for i in range(24)]
    batch = uuid.uuid4().hex
    batch_rows = [
        {
            "prompt": [{"role": "user", "content": "go"}],
            "agent_name": "probe_ordered_turn",
            "extra_info": {
                "length": length,
                "batch": batch,
                "index": i,
                "after": "finished" if length == 64 else "placed",
            },
        }
        for i, length in enumerate(lengths)
    ]
    batch = one_router_manager.generate_sequences(batch_rows)
    assert batch.batch["response_mask"].sum(1).tolist() == lengths
    tokens = [0, 0]
    for extra, length in zip(batch.non_tensor_batch["extra_fields"], lengths):
        tokens[extra["server"]] += length
    assert max(tokens) / (sum(tokens) / len(tokens)) <= 1.5, tokens
    assert batch.meta_info["rollout/in_flight_imbalance"] <= 1.3


def test_dead_server_loses_no_sample(one_router_manager):
    batch_rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "agent_name": "fixed_length", "extra_info": {"length": 300}}
        for i in range(16)
    ]

    def kill_once_busy(server):
        # killed mid-generation (a 300-token trajectory takes seconds), whatever the machine's speed
        deadline = time.monotonic() + 60
        while ray.get(server.in_flight.remote(), timeout=10) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        ray.kill(server)

    killer = threading.Thread(target=kill_once_busy, args=[one_router_manager.servers[0]])
    killer.start()
    batch = one_router_manager.generate_sequences(batch_rows)
    killer.join()
    assert len(batch) == 16
    assert batch.batch["response_mask"].sum(1).tolist() == [300] * 16
    # the dead server's sessions were re-sent to the live one
    per_server = batch.meta_info["rollout/requests_per_server"]
    assert per_server[1] == 16 and per_server[0] + per_server[1] > 16
    # and once the batch is done, the dead server is replaced on its rank
    assert [(event.rank, event.kind) for event in one_router_manager.pool.events] == [(0, "restarted")]
    assert batch.meta_info["supervision/server_restarts"] == 1
