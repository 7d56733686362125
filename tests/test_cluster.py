"""The manager's Ray: one it starts itself with the job's settings, two nodes on one machine (servers are placed on
both and the batch still comes back), and training on three nodes, each component placed on its own node by the custom
resources the settings name."""

import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentloop import AgentLoopManager
from agentloop.rows import write_rows
from agentloop.tasks.arithmetic.data import make_rows
from tests.support.config import small_config
from tests.test_main_ppo import TOOL_RUN
from tests.test_supervision import perturbed
from tests.test_weight_sync import Source, hf_greedy, served
from trainer.ray_trainer import RayPPOTrainer

# one node per part of the job, each offering a resource of its own (as `ray start --resources` would)
NODES = {"agent_node": 1, "rollout_node": 1, "trainer_node": 0}
PLACEMENT = [
    "trainer.resources_per_rank={trainer_node: 1}",
    "+actor_rollout_ref.rollout.resources_per_server.rollout_node=1",
    "actor_rollout_ref.rollout.agent.num_workers=2",
    "actor_rollout_ref.rollout.agent.resources_per_worker={agent_node: 1}",
]


@pytest.fixture
def two_node_cluster():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def three_node_cluster():
    """Node name -> node id: the head offers ``agent_node``, the others ``rollout_node`` and ``trainer_node``."""
    if ray.is_initialized():
        ray.shutdown()
    (head, head_cpus), *others = NODES.items()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "resources": {head: 4}, "include_dashboard": False},
    )
    nodes = {head: cluster.head_node.node_id}
    for name, cpus in others:
        nodes[name] = cluster.add_node(num_cpus=cpus, resources={name: 4}).node_id
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    cluster.shutdown()


def node_of(actor: ray.actor.ActorHandle) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()), timeout=60)


RUNS = {
    "synchronous": [],
    "asynchronous": ["async_training.max_staleness=1", "async_training.partial_rollout=true"],
    "collective": ["actor_rollout_ref.rollout.weight_sync=collective"],
}


@pytest.mark.parametrize("run", list(RUNS))
def test_training_places_each_part_on_its_node(three_node_cluster, tmp_path, run):
    """Two ranks on the trainer's node, the server on the rollout node, two workers on the agents' node; three steps
    train there, synchronously, with the asynchronous stream, and with weights broadcast over a process group of
    rank 0 and the server; after the last push the server serves the trained policy."""
    train = write_rows(make_rows(8), str(tmp_path / "train.jsonl"))
    config = small_config(
        *TOOL_RUN,
        *PLACEMENT,
        *RUNS[run],
        "actor_rollout_ref.rollout.free_cache_engine=false",  # the server stays awake to be asked after the run
        f"data.train_files=[{train}]",
        "trainer.total_training_steps=3",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    trainer = RayPPOTrainer(config)
    try:
        assert {node_of(rank) for rank in trainer.workers} == {three_node_cluster["trainer_node"]}
        assert {info["node_id"] for info in trainer.manager.server_info()} == {three_node_cluster["rollout_node"]}
        workers = trainer.manager.workers.handles
        assert len(workers) == 2 and {node_of(worker) for worker in workers} == {three_node_cluster["agent_node"]}
        lines = trainer.fit()
        trained = ray.get([rank.full_state_dict.remote() for rank in trainer.workers], timeout=120)[0]
        expected = hf_greedy(config.actor_rollout_ref.model.path, trained)
        assert served(trainer.manager) == [(expected, 3)]
    finally:
        trainer.shutdown(60.0)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["rollout/failed_samples"] == 0 for line in lines)


def test_a_resource_no_node_offers_is_refused_naming_its_key(three_node_cluster):
    with pytest.raises(ValueError, match=r"resources_per_worker asks for \['gpu_node'\], which no node"):
        AgentLoopManager(
            small_config(
                "actor_rollout_ref.rollout.agent.num_workers=1",
                "actor_rollout_ref.rollout.agent.resources_per_worker={gpu_node: 1}",
            )
        )


def test_a_manager_without_ray_starts_one_as_the_command_does(monkeypatch):
    """Not ``ray.init()``'s default (join whatever cluster runs on the machine): the job's own Ray, with
    ``ray_kwargs.ray_init``."""
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    manager = AgentLoopManager(small_config("ray_kwargs.ray_init.num_cpus=3"))
    try:
        assert ray.cluster_resources()["CPU"] == 3  # a bare ray.init() would count this machine's cores
        assert len(manager.generate_sequences([{"prompt": [{"role": "user", "content": "question"}]}])) == 1
    finally:
        manager.shutdown()
        ray.shutdown()


def test_servers_spread_over_two_nodes(two_node_cluster):
    manager = AgentLoopManager(small_config("actor_rollout_ref.rollout.data_parallel_size=2"))
    try:
        nodes = {info["node_id"] for info in manager.server_info()}
        assert nodes == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert len(nodes) == 2
        batch = manager.generate_sequences(
            [{"prompt": [{"role": "user", "content": f"question {i}"}]} for i in range(8)]
        )
        assert len(batch) == 8
        assert all(count > 0 for count in batch.meta_info["rollout/requests_per_server"])
    finally:
        manager.shutdown()


def test_a_lost_node_moves_its_server_where_resources_allow_and_ends_the_run_where_none_do(tmp_path):
    """Two nodes offer the servers' resource: the one holding the server is removed between pushes, the server comes
    back on the other with the latest weights (a collective group of its own) and the next push reaches it; once no
    node offers the resource, the next rollout fails within server_startup_timeout_s naming the bundle and what the
    cluster has free."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    spare = [cluster.add_node(num_cpus=1, resources={"rollout_node": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    startup_timeout_s = 20
    manager = AgentLoopManager(
        small_config(
            "+actor_rollout_ref.rollout.resources_per_server.rollout_node=1",
            "actor_rollout_ref.rollout.weight_sync=collective",
            "actor_rollout_ref.rollout.weight_sync_timeout_s=30",
            f"actor_rollout_ref.rollout.server_startup_timeout_s={startup_timeout_s}",
            "actor_rollout_ref.rollout.agent.num_workers=1",
        )
    )
    model_path, rows = manager.config.actor_rollout_ref.model.path, [{"prompt": [{"role": "user", "content": "q"}]}]
    # the weights' source plays trainer rank 0, on a node that stays (the head): placed freely it could land on the
    # node removed below, and a replacement's weights would die with it
    on_head = Source.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    )
    try:
        state = perturbed(model_path, 1)
        manager.update_weights_collective(on_head.remote(state), version=1)
        [first] = [node for node in spare if node.node_id == manager.server_info()[0]["node_id"]]
        cluster.remove_node(first)
        assert len(manager.generate_sequences(rows)) == 1
        [event] = manager.pool.events
        assert (event.rank, event.kind) == (0, "restarted")
        [survivor] = [node for node in spare if node is not first]
        assert manager.server_info()[0]["node_id"] == survivor.node_id
        assert served(manager) == [(hf_greedy(model_path, state), 1)]
        state = perturbed(model_path, 2)
        manager.update_weights_collective(on_head.remote(state), version=2)
        assert served(manager) == [(hf_greedy(model_path, state), 2)]

        cluster.remove_node(survivor)
        start = time.monotonic()
        with pytest.raises(Exception) as failure:
            manager.generate_sequences(rows)
        elapsed = time.monotonic() - start
        message = str(failure.value)
        assert "the replacement of rollout server 0 to start" in message and "'rollout_node': 1.0" in message, message
        assert "the cluster now offers" in message and elapsed < startup_timeout_s + 30, (elapsed, message)
    finally:
        manager.shutdown()
        ray.shutdown()
        cluster.shutdown()
