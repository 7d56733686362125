"""``AgentLoopManager``: starts the rollout servers and agent-loop workers, and turns rows into a batch."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Mapping

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentloop.batch import RolloutBatch
from agentloop.metrics import rollout_metrics
from agentloop.protocol import is_failed
from agentloop.registry import check_agent_names, resolve_agent_loops
from agentloop.router import RouterStats
from agentloop.rows import check_row
from agentloop.server.rollout_server import RolloutServer
from agentloop.server.weights import PackedWeights
from agentloop.waiting import wait_for
from agentloop.worker import AgentLoopWorker

ROW_FIELDS = ("prompt", "agent_name", "data_source", "reward_model", "extra_info")

logger = logging.getLogger(__name__)


class AgentLoopManager:
    """Data-parallel rollout servers plus ``agent.num_workers`` workers on the current Ray cluster.

    Starts a local Ray instance when none is connected; to use a cluster, call
    ``ray.init(address=...)`` first. ``server_addresses`` lists each server's HTTP base URL
    (``rollout.http``).
    """

    def __init__(self, config: DictConfig) -> None:
        config = config.copy()
        OmegaConf.resolve(config)  # builds the default tiny model here, once, before any actor needs it
        _absolute_paths(config)
        self.config = config
        self.rollout = config.actor_rollout_ref.rollout
        if not ray.is_initialized():
            ray.init()
        timeout = float(self.rollout.server_startup_timeout_s)
        check_agent_names({self.rollout.agent.default_agent_loop}, self._agent_loops())

        self.servers, self.placement_group = self._start_servers(timeout)
        self.server_addresses: list[str] = (
            wait_for([server.start_http.remote() for server in self.servers], timeout, "HTTP servers to start")
            if self.rollout.http.enable
            else []
        )
        self.workers = [
            AgentLoopWorker.options(num_cpus=0).remote(config, self.servers)
            for _ in range(int(self.rollout.agent.num_workers))
        ]
        wait_for([worker.__ray_ready__.remote() for worker in self.workers], timeout, "agent loop workers to start")

    def _start_servers(self, timeout: float) -> tuple[list[ray.actor.ActorHandle], Any]:
        size = int(self.rollout.data_parallel_size)
        bundle = {key: float(value) for key, value in self.rollout.resources_per_server.items() if value}
        group = placement_group([dict(bundle) for _ in range(size)], strategy=self.rollout.placement_strategy)
        wait_for(
            [group.ready()],
            timeout,
            f"resources for {size} rollout server(s) of {bundle} each "
            f"(cluster has {ray.cluster_resources()}; lower actor_rollout_ref.rollout.resources_per_server "
            "or data_parallel_size)",
        )
        servers = [
            RolloutServer.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote(self.config, rank)
            for rank in range(size)
        ]
        wait_for([server.__ray_ready__.remote() for server in servers], timeout, "rollout servers to load their engines")
        return servers, group

    # ------------------------------------------------------------------ rollout

    def generate_sequences(self, rows: list[dict[str, Any]], validate: bool = False) -> RolloutBatch:
        """Roll out every row (``rollout.n`` times each, ``val_kwargs.n`` when validating) into one padded batch.

        Rows are verl dataset rows: ``prompt`` (chat messages) and optionally ``agent_name``,
        ``data_source``, ``reward_model``, ``extra_info`` and any other fields, which ride along in
        ``non_tensor_batch``. Samples of one row share a ``uid`` (the GRPO group); ``index`` is the
        row's dataset index (``extra_info.index``, as in verl; None without one).
        """
        if not rows:
            raise ValueError("generate_sequences needs at least one row")
        samples = self._expand(rows, validate)
        names = {sample["agent_name"] for sample in samples}
        registered = self._agent_loops()
        check_agent_names(names, registered)
        # Only the loops this batch uses travel: an unrelated registration need not be importable remotely.
        agent_loops = {name: registered[name] for name in names}
        sampling_params = self._sampling_params(validate)

        start = time.perf_counter()
        chunks = np.array_split(np.arange(len(samples)), min(len(self.workers), len(samples)))
        refs = [
            worker.generate_sequences.remote([samples[i] for i in chunk], sampling_params, agent_loops)
            for worker, chunk in zip(self.workers, chunks)
        ]
        # Each trajectory's turns are individually bounded by request_timeout_s; the batch as a whole
        # is bounded by generate_timeout_s.
        parts: list[tuple[RolloutBatch, RouterStats]] = wait_for(
            refs, float(self.rollout.generate_timeout_s), f"{len(samples)} trajectories to finish"
        )
        elapsed = time.perf_counter() - start
        batch = RolloutBatch.concat([part for part, _ in parts])
        self._check_failures(batch)
        batch.meta_info = rollout_metrics(batch, RouterStats.merge([stats for _, stats in parts]), elapsed)
        return batch

    def _check_failures(self, batch: RolloutBatch) -> None:
        """Raise with the first traceback when more than ``rollout.max_failed_sample_ratio`` of the samples failed."""
        failures = [extra["failure"] for extra in batch.non_tensor_batch["extra_fields"] if is_failed(extra)]
        limit = float(self.rollout.max_failed_sample_ratio)
        if len(failures) > limit * len(batch):
            raise RuntimeError(
                f"{len(failures)} of {len(batch)} samples failed, more than actor_rollout_ref.rollout.max_failed_sample_ratio"
                f"={limit:g} allows; the first failure:\n{failures[0]['traceback']}"
            )

    def _agent_loops(self) -> dict[str, dict[str, Any]]:
        # Resolved per call, so loops registered after the manager started are found too.
        return resolve_agent_loops(self.rollout.agent.agent_loop_config_path)

    def _expand(self, rows: list[dict[str, Any]], validate: bool) -> list[dict[str, Any]]:
        for position, row in enumerate(rows):
            check_row(row, f"row {position} of the batch")
        repeats = int(self.rollout.val_kwargs.n if validate else self.rollout.n)
        keys = list(dict.fromkeys([*ROW_FIELDS, *(key for row in rows for key in row)]))
        samples = []
        for row in rows:
            uid = str(uuid.uuid4())
            for _ in range(repeats):
                sample = {key: row.get(key) for key in keys}
                sample["agent_name"] = sample["agent_name"] or self.rollout.agent.default_agent_loop
                sample.update(index=(row.get("extra_info") or {}).get("index"), uid=uid, request_id=str(uuid.uuid4()))
                samples.append(sample)
        return samples

    def _sampling_params(self, validate: bool) -> dict[str, Any]:
        source = self.rollout.val_kwargs if validate else self.rollout
        return {
            "max_new_tokens": int(self.rollout.response_length),
            "temperature": float(source.temperature),
            "top_p": float(source.top_p),
            "top_k": int(source.top_k),
        }

    # ------------------------------------------------------------------ servers

    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | PackedWeights | ray.ObjectRef) -> None:
        """Push new weights to every server (in place; prefix caches flushed).

        ``state_dict`` may also be the ``ObjectRef`` of one (plain or packed) that a trainer rank returned:
        the servers then read it from the object store, and it never passes through this process.
        """
        if isinstance(state_dict, ray.ObjectRef):
            ref = state_dict
        else:
            # Packed once here, the bytes are stored once and every server maps them without unpickling.
            ref = ray.put(state_dict if isinstance(state_dict, PackedWeights) else PackedWeights.pack(state_dict))
        wait_for([server.update_weights.remote(ref) for server in self.servers], self._control_timeout, "weight update")

    def sleep(self) -> None:
        """Free every server's KV cache."""
        wait_for([server.sleep.remote() for server in self.servers], self._control_timeout, "servers to sleep")

    def wake_up(self) -> None:
        """Re-allocate every server's KV cache."""
        wait_for([server.wake_up.remote() for server in self.servers], self._control_timeout, "servers to wake up")

    def server_info(self) -> list[dict[str, Any]]:
        """Where each server runs (node id, host, pid)."""
        return wait_for([server.node_info.remote() for server in self.servers], self._control_timeout, "server info")

    @property
    def _control_timeout(self) -> float:
        return float(self.rollout.server_startup_timeout_s)

    def shutdown(self) -> None:
        """Stop workers and servers and release their resources (a server's engine is asked to stop first)."""
        try:
            wait_for([server.shutdown.remote() for server in self.servers], self._control_timeout, "servers to shut down")
        except Exception as error:  # a dead or stuck server: killing it below is all that is left
            logger.warning("rollout servers did not shut down cleanly (%s); killing them", error)
        for actor in [*self.workers, *self.servers]:
            ray.kill(actor)
        remove_placement_group(self.placement_group)


def _absolute_paths(config: DictConfig) -> None:
    """Make file paths absolute: actors do not share the driver's working directory."""
    rollout = config.actor_rollout_ref.rollout
    for section, key in ((rollout.agent, "agent_loop_config_path"), (rollout.multi_turn, "tool_config_path")):
        if section[key]:
            section[key] = os.path.abspath(section[key])
