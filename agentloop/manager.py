"""``AgentLoopManager``: starts the rollout servers and agent-loop workers, and turns rows into a batch."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Callable, Iterator, Mapping

import ray
import torch
from omegaconf import DictConfig, OmegaConf

from agentloop.batch import RolloutBatch
from agentloop.cluster import start_ray
from agentloop.judge.pool import start_judge_pool
from agentloop.metrics import rollout_metrics
from agentloop.preparation import check_paths
from agentloop.registry import check_agent_names, resolve_agent_loops
from agentloop.router import RouterStats
from agentloop.rows import check_row, verl_row_fields
from agentloop.server_pool import ServerPool
from agentloop.server.weights import PackedWeights
from agentloop.settings import judge_settings, rollout_settings
from agentloop.streaming import GroupStream, Prepared
from agentloop.worker_pool import WorkerPool

ROW_FIELDS = ("prompt", "agent_name", "data_source", "reward_model", "extra_info")


class AgentLoopManager:
    """Data-parallel rollout servers (``pool``) plus ``agent.num_workers`` workers (``workers``) on the current Ray
    cluster.

    When this process is not connected to Ray yet, it joins ``trainer.ray_address`` (or RAY_ADDRESS) or starts a Ray
    of its own with ``ray_kwargs.ray_init``, as the trainer's command does (``agentloop.cluster``): never whatever
    cluster another job left running on the machine. ``server_addresses`` lists each server's HTTP base URL
    (``rollout.http``).

    The models the config names must exist: call ``agentloop.preparation.prepare(config)`` first when they are built
    by its ``task.prepare`` steps (the default tiny model included); building the manager builds nothing.
    """

    def __init__(self, config: DictConfig) -> None:
        config = config.copy()
        OmegaConf.resolve(config)  # interpolations only: the models it names were built by prepare(config)
        check_paths(config, data=False)
        _absolute_paths(config)
        self.config = config  # what the agent loops and reward functions are given (verl's contract)
        # each part's own settings, read and checked once here, before anything starts
        self.settings = rollout_settings(config)
        self.judge_settings = judge_settings(config, self.settings.servers)
        start_ray(config)
        timeout = self.settings.servers.startup_timeout_s
        self.default_agent_loop = self.settings.agent.default_agent_loop
        check_agent_names({self.default_agent_loop}, self._agent_loops())

        # a replacement server is handed to every worker (the workers start second: they are given the servers)
        self.judges = start_judge_pool(self.judge_settings, lambda rank, server: self.workers.give_judge(rank, server))
        self.pool = ServerPool(self.settings.servers, lambda rank, server: self.workers.give_server(rank, server))
        try:
            # the workers load their tokenizers while the servers (and the judge's) load their engines
            self.workers = WorkerPool(config, self.settings, self.judge_settings, self.pool, self.judges)
            self.pool.wait_until_serving()
            if self.judges is not None:
                self.judges.wait_until_serving()
            self.workers.wait_until_ready(timeout)
        except BaseException:  # a server or worker that failed to start: none of them is left running
            self.shutdown(graceful=False)
            raise

    @property
    def servers(self) -> list[ray.actor.ActorHandle]:
        """The current server of each data-parallel rank (a replaced one's successor)."""
        return self.pool.servers

    @property
    def server_addresses(self) -> list[str]:
        """Each server's HTTP base URL (``rollout.http``; empty when off)."""
        return self.pool.addresses

    # ------------------------------------------------------------------ rollout

    def servers_idle_share_from_now(self) -> Callable[[], float]:
        """A clock of the servers' idleness from now: it returns their mean share of the time since it was made with
        nothing to generate (``ServerPool.idle_share_since``)."""
        start, busy = time.perf_counter(), self.pool.busy_s()
        return lambda: self.pool.idle_share_since(busy, start)

    def generate_sequences(self, rows: list[dict[str, Any]], validate: bool = False) -> RolloutBatch:
        """Roll out every row (``rollout.n`` times each, ``val_kwargs.n`` when validating) into one padded batch.

        Rows are verl dataset rows: ``prompt`` (chat messages) and optionally ``agent_name``,
        ``data_source``, ``reward_model``, ``extra_info`` and any other fields, which ride along in
        ``non_tensor_batch``. Samples of one row share a ``uid`` (the GRPO group); ``index`` is the
        row's dataset index (``extra_info.index``, as in verl; None without one).
        """
        if not rows:
            raise ValueError("generate_sequences needs at least one row")
        samples, agent_loops, params = self._prepare(rows, validate)

        self._check_judges()
        self.pool.check()  # a server that died since the last call is replaced before this one starts
        start = time.perf_counter()
        # Each trajectory's turns are individually bounded by request_timeout_s; the batch as a whole
        # is bounded by generate_timeout_s.
        deadline = time.monotonic() + self.settings.generate_timeout_s
        parts = self.workers.run_chunks(
            self.workers.split(samples), params, agent_loops, deadline, while_waiting=self._replace_if_all_dead
        )
        stats = RouterStats.merge([part_stats for _, part_stats in parts])
        # servers that died or hung during the rollout (their sessions were re-homed) are replaced now
        self.pool.check(unhealthy=stats.unhealthy_ranks)
        elapsed = time.perf_counter() - start
        return self._finish_batch(RolloutBatch.concat([part for part, _ in parts]), stats, elapsed)

    def _finish_batch(self, batch: RolloutBatch, stats: RouterStats, elapsed_s: float) -> RolloutBatch:
        """Fail on too many failed samples (``_check_failures``), else give ``batch`` its rollout metrics and the
        supervision so far (cumulative: replaced and given-up servers, replaced workers)."""
        self._check_judges()  # a judge that died during the rollout is replaced, whether or not the batch fails for it
        self._check_failures(batch)
        batch.meta_info = {
            **rollout_metrics(batch, stats, elapsed_s),
            "supervision/server_restarts": sum(event.kind == "restarted" for event in self.pool.events),
            "supervision/servers_given_up": len(self.pool.given_up),
            "supervision/worker_restarts": self.workers.restarts,
        }
        if self.judges is not None:
            batch.meta_info["supervision/judge_restarts"] = sum(
                event.kind == "restarted" for event in self.judges.events
            )
        return batch

    def _replace_if_all_dead(self) -> None:
        """While a rollout runs: every server of the policy (or of the judge) dead means turns waiting for one."""
        self.pool.replace_if_all_dead()
        if self.judges is not None:
            self.judges.replace_if_all_dead()

    def _check_judges(self) -> None:
        if self.judges is not None:
            self.judges.check()

    def _prepare(self, rows: list[dict[str, Any]], validate: bool = False) -> Prepared:
        """Rows checked and expanded into samples (``n`` per row, consecutive, one ``uid`` each), the specs of the
        agent loops they name, and the sampling params."""
        samples = self._expand(rows, validate)
        names = {sample["agent_name"] for sample in samples}
        registered = self._agent_loops()
        check_agent_names(names, registered)
        # Only the loops this batch uses travel: an unrelated registration need not be importable remotely.
        return samples, {name: registered[name] for name in names}, self.settings.sampling_params(validate)

    def stream(
        self,
        steps: Iterator[list[dict[str, Any]]],
        groups_per_batch: int,
        max_staleness: int,
        capacity: int,
        version: int = 0,
        *,
        keep: Callable[[RolloutBatch], bool] | None = None,
        max_dropped: int = 0,
        order: str = "finished",
    ) -> GroupStream:
        """Roll out continuously: each item of ``steps`` is one training step's rows; finished GRPO groups wait
        in a bounded buffer for ``GroupStream.take`` (see ``agentloop.streaming``); ``keep`` drops the groups it
        refuses as they finish (dynamic sampling); ``order`` says which finished groups a batch takes."""
        return GroupStream(
            self.workers,
            self.pool,
            self._prepare,
            self._finish_batch,
            steps,
            groups_per_batch,
            max_staleness,
            capacity,
            version,
            keep=keep,
            max_dropped=max_dropped,
            order=order,
        )

    def _check_failures(self, batch: RolloutBatch) -> None:
        """Raise with the first traceback when more than ``rollout.max_failed_sample_ratio`` of the samples failed."""
        failures = [
            failure for failure in batch.non_tensor_batch["failure"][batch.last_segments()] if failure is not None
        ]
        limit, samples = self.settings.max_failed_sample_ratio, batch.num_trajectories
        if len(failures) > limit * samples:
            raise RuntimeError(
                f"{len(failures)} of {samples} samples failed, more than actor_rollout_ref.rollout.max_failed_sample_ratio"
                f"={limit:g} allows; the first failure:\n{failures[0].traceback}"
            )

    def _agent_loops(self) -> dict[str, dict[str, Any]]:
        # Resolved per call, so loops registered after the manager started are found too.
        return resolve_agent_loops(self.settings.agent.agent_loop_config_path)

    def _expand(self, rows: list[dict[str, Any]], validate: bool) -> list[dict[str, Any]]:
        for position, row in enumerate(rows):
            check_row(row, f"row {position} of the batch")
        repeats = self.settings.val_n if validate else self.settings.n
        keys = list(dict.fromkeys([*ROW_FIELDS, *(key for row in rows for key in row)]))
        samples = []
        for row in rows:
            uid = str(uuid.uuid4())
            for _ in range(repeats):
                sample = {key: row.get(key) for key in keys}
                sample["agent_name"] = sample["agent_name"] or self.default_agent_loop
                sample.update(verl_row_fields(row), uid=uid, request_id=str(uuid.uuid4()))
                samples.append(sample)
        return samples

    # ------------------------------------------------------------------ servers

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor] | PackedWeights | ray.ObjectRef, version: int | None = None
    ) -> None:
        """Push new weights to every server (in place; prefix caches flushed); a server that died is replaced
        and gets them too. ``version`` numbers the policy (the trainer passes the updates applied); tokens
        are stamped with it. Requests in flight are interrupted and continue under the new weights.

        ``state_dict`` may also be the ``ObjectRef`` of one (plain or packed) that a trainer rank returned:
        the servers then read it from the object store, and it never passes through this process.
        """
        if isinstance(state_dict, ray.ObjectRef):
            ref = state_dict
        else:
            # Packed once here, the bytes are stored once and every server maps them without unpickling.
            ref = ray.put(state_dict if isinstance(state_dict, PackedWeights) else PackedWeights.pack(state_dict))
        self.pool.update_weights(ref, version)

    def update_weights_from_disk(self, directory: str, version: int | None = None) -> None:
        """Load a checkpoint directory every server can read (the trainer's path with ``rollout.weight_sync=disk``)
        into every server, as policy ``version``."""
        self.pool.update_weights_from_disk(directory, version)

    def update_weights_collective(self, source: ray.actor.ActorHandle, version: int | None = None) -> None:
        """Broadcast the weights that ``source`` (trainer rank 0, an ``agentloop.server.collective.WeightSource``
        whose ``keep_weights`` holds them) keeps to every server over a group made for this push
        (the trainer's path with ``rollout.weight_sync=collective``), as policy ``version``."""
        self.pool.update_weights_collective(source, version)

    def sleep(self) -> None:
        """Free every server's KV cache (the judge's too, with ``reward_model.rollout.free_cache_engine``)."""
        self.pool.sleep()
        if self.judges is not None and self.judge_settings.free_cache_engine:
            self.judges.sleep()

    def wake_up(self) -> None:
        """Re-allocate every server's KV cache."""
        self.pool.wake_up()
        if self.judges is not None and self.judge_settings.free_cache_engine:
            self.judges.wake_up()

    def server_info(self) -> list[dict[str, Any]]:
        """Where each live server runs (node id, host, pid)."""
        return self.pool.node_info()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop workers and servers and release their resources (a server's engine is asked to stop first, when
        ``graceful``)."""
        if hasattr(self, "workers"):  # (not when a judge server failed to start)
            self.workers.shutdown()
        self.pool.shutdown(graceful)
        if self.judges is not None:
            self.judges.shutdown(graceful)


def _absolute_paths(config: DictConfig) -> None:
    """Make file paths absolute: actors do not share the driver's working directory."""
    rollout = config.actor_rollout_ref.rollout
    paths = (
        (rollout.agent, "agent_loop_config_path"),
        (rollout.multi_turn, "tool_config_path"),
        (rollout.multi_turn, "interaction_config_path"),
        (config.custom_reward_function, "path"),
    )
    for section, key in paths:
        if section[key] and "://" not in section[key]:  # pkg://module names a module, not a file
            section[key] = os.path.abspath(section[key])
