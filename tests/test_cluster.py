"""The manager's Ray: one it starts itself with the job's settings, or two nodes on one machine (servers are placed
on both and the batch still comes back)."""

import pytest
import ray
from ray.cluster_utils import Cluster

from agentloop import AgentLoopManager
from tests.support.config import small_config


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
