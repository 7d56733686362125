"""``AgentLoopWorker``: runs one asyncio task per sample and pads the results, as a Ray actor or on an event-loop thread
of the driver (``agentloop.worker_pool``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import traceback
from typing import Any

import numpy as np
import ray
from omegaconf import DictConfig
from transformers import AutoTokenizer

from agentloop.agent_loop.base import DictConfigWrap
from agentloop.judge import Judge, judge_session
from agentloop.batch import RolloutBatch, object_array
from agentloop.gateway import Gateway
from agentloop.models.loading import load_processor, structure
from agentloop.postprocess import check_reward_has_a_token, pad_outputs
from agentloop.protocol import BATCH_FIELDS, SCORE_FIELDS, AgentLoopOutput, Failure, SampleScore
from agentloop.registry import ADAPTER_FIELD, build_agent_loop, sample_adapter
from agentloop.rewards import score_output
from agentloop.router import Router, RouterStats
from agentloop.settings import JudgeSettings, RolloutSettings

logger = logging.getLogger(__name__)


def settle_collector() -> None:
    """Tune this process's cyclic garbage collector for a worker's life of many small, short-lived requests.

    What exists now (the imported libraries, the tokenizer) lives as long as the worker: frozen out of the collector's
    scans, a full collection amid a step's calls takes milliseconds instead of a fifth of a second (the gateway's
    calls at 64 sessions stalled on them). The youngest generation is collected every 10,000 allocations instead of
    700: the requests in flight at 64 sessions triggered one every few calls (the gateway's collections 53 -> 11 ms in
    a benchmark run); what they leave is freed by reference counting, not by the collector."""
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


class AgentLoopWorker:
    """Owns a router over every rollout server (and a ``Judge`` over the judge's, with ``reward_model.enable``) and turns
    a chunk of rows into a padded batch."""

    def __init__(
        self,
        config: DictConfig,
        settings: RolloutSettings,
        judge: JudgeSettings | None,
        servers: list[ray.actor.ActorHandle],
        judges: list[ray.actor.ActorHandle] | None = None,  # the judge's servers, with reward_model.enable
    ) -> None:
        """``config``: the composed config, which the agent loops and reward functions are given (verl's contract);
        the worker itself runs on ``settings`` (the rollout's) and ``judge`` (the judge's)."""
        self.config = config
        self.settings = settings
        path = settings.servers.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = load_processor(path)  # None for a text-only model
        self.vision_model = structure(path)
        self.router = Router(
            servers,
            request_timeout_s=settings.servers.request_timeout_s,
            health_timeout_s=settings.servers.supervision.health_timeout_s,
            group_affinity_slack=settings.agent.group_affinity_slack,
        )
        self.judge = Judge.from_settings(judge, judges) if judge is not None and judges is not None else None
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._groups: dict[int, asyncio.Task] = {}  # streamed groups in flight
        self._finished: list[tuple[int, RolloutBatch | Exception]] = []
        self._group_done = asyncio.Event()
        self._gateway: Gateway | None = None  # made when a loop first asks for it (external_agent)
        # Only in a process of its own: a worker in the driver (num_workers=0) would freeze the driver's objects too,
        # cyclic garbage among them
        if ray.get_runtime_context().get_actor_id() is not None:
            settle_collector()

    def gateway(self) -> Gateway:
        """This worker's session gateway, over its router (made on first use; it serves from its first session)."""
        if self._gateway is None:
            template_kwargs = self.config.data.get("apply_chat_template_kwargs")  # (verl's dataset_config)
            self._gateway = Gateway(self.router, self.tokenizer, self.settings, template_kwargs)
        return self._gateway

    def shutdown(self) -> None:
        """Stop what this worker serves (the gateway): its pool is shutting it down."""
        if self._gateway is not None:
            self._gateway.stop()

    async def generate_sequences(
        self, rows: list[dict[str, Any]], sampling_params: dict[str, Any], agent_loops: dict[str, dict[str, Any]]
    ) -> tuple[RolloutBatch, RouterStats]:
        """Run every row's agent loop (specs by name in ``agent_loops``) concurrently; pad in row order.

        Returns the padded batch and this worker's router counters for the call.
        """
        rows = with_adapters(rows, agent_loops)
        results = await asyncio.gather(*(self._run_one(row, sampling_params, agent_loops) for row in rows))
        return self._pad(rows, results), self.router.take_stats()

    # ------------------------------------------------------------------ streaming (agentloop.streaming)

    async def start_group(
        self,
        group_id: int,
        rows: list[dict[str, Any]],
        sampling_params: dict[str, Any],
        agent_loops: dict[str, dict[str, Any]],
    ) -> None:
        """Start one GRPO group's samples; the padded group is handed out by ``finished_groups`` once all are done."""

        rows = with_adapters(rows, agent_loops)

        async def run_group() -> None:
            try:
                results = await asyncio.gather(*(self._run_one(row, sampling_params, agent_loops) for row in rows))
                self._finished.append((group_id, self._pad(rows, results)))
            except Exception as error:  # padding failed: the stream raises it rather than wait for the group
                self._finished.append((group_id, error))
            self._groups.pop(group_id, None)
            self._group_done.set()

        self._groups[group_id] = asyncio.get_running_loop().create_task(run_group())

    async def finished_groups(self, wait_s: float) -> tuple[list[tuple[int, RolloutBatch | Exception]], RouterStats]:
        """The groups finished since the last call (a group whose padding failed: the error), waiting up to
        ``wait_s`` for one; the router's counters."""
        if not self._finished:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._group_done.wait(), wait_s)
        finished, self._finished = self._finished, []
        self._group_done.clear()
        return finished, self.router.take_stats()

    async def cancel_groups(self) -> int:
        """Drop every group in flight and every finished one not yet handed out (a stopping stream: a later
        stream numbers its groups from 0 again); how many were in flight."""
        for task in self._groups.values():
            task.cancel()
        cancelled, self._groups = len(self._groups), {}
        self._finished = []
        self._group_done.clear()
        return cancelled

    def _pad(
        self, rows: list[dict[str, Any]], results: list[tuple[AgentLoopOutput, SampleScore, float]]
    ) -> RolloutBatch:
        """One row per segment; a trajectory's per-sample columns repeat on each of its rows."""
        outputs = [output for output, _, _ in results]
        batch = pad_outputs(
            outputs,
            self.settings.servers.prompt_length,
            self.settings.servers.response_length,
            self._pad_id,
            self.vision_model,
        )
        segments = [output.all_segments() for output in outputs]
        repeats = [len(parts) for parts in segments]

        def column(values: list[Any]) -> np.ndarray:
            return object_array([value for value, count in zip(values, repeats) for _ in range(count)])

        non_tensor = {key: column([row.get(key) for row in rows]) for key in rows[0]}
        non_tensor.update({name: column([getattr(output, name) for output in outputs]) for name in BATCH_FIELDS})
        non_tensor.update({name: column([getattr(score, name) for _, score, _ in results]) for name in SCORE_FIELDS})
        non_tensor["generate_time_s"] = column([seconds for _, _, seconds in results])
        non_tensor["rewritten_by"] = object_array([segment.rewritten_by for parts in segments for segment in parts])
        return RolloutBatch(batch, non_tensor, {"pad_token_id": self._pad_id})

    def replace_server(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Route to ``server`` for ``rank`` from now on (the manager replaced a dead one)."""
        self.router.replace(rank, server)

    def replace_judge(self, rank: int, server: ray.actor.ActorHandle) -> None:
        """Call ``server`` for the judge's ``rank`` from now on."""
        self.judge.replace(rank, server)

    async def _run_one(
        self, row: dict[str, Any], sampling_params: dict[str, Any], agent_loops: dict[str, dict[str, Any]]
    ) -> tuple[AgentLoopOutput, SampleScore, float]:
        start = time.perf_counter()
        with judge_session(self.judge, row["request_id"]) as judge_calls:
            output, score = await self._run_loop(row, sampling_params, agent_loops)
        score.judge_calls = judge_calls
        generated = self.router.take_versions(row["request_id"])  # (taken either way: the router forgets them)
        if not output.has_policy_versions():  # a loop that kept no versions with its tokens (one written for verl)
            output.set_policy_versions(generated)
        return output, score, time.perf_counter() - start

    async def _run_loop(
        self, row: dict[str, Any], sampling_params: dict[str, Any], agent_loops: dict[str, dict[str, Any]]
    ) -> tuple[AgentLoopOutput, SampleScore]:
        try:
            with self.router.running_sample(row["request_id"], row.get("uid"), row.get(ADAPTER_FIELD)):
                loop = build_agent_loop(
                    agent_loops[row["agent_name"]],
                    trainer_config=DictConfigWrap(self.config),
                    server_manager=self.router,
                    tokenizer=self.tokenizer,
                    processor=self.processor,
                    dataset_cls=None,
                    dataset_config=DictConfigWrap(self.config.data),
                    offered={
                        "gateway": self.gateway,
                        "judge": lambda: self.judge,
                    },
                )
                output = await loop.run(dict(sampling_params), **row)
                score = await score_output(self.settings.rewards, self.tokenizer, row, output, self.judge)
                check_reward_has_a_token(output)  # a reward the batch would drop fails its sample instead
                return output, score
        except (
            Exception
        ) as error:  # one sample's fault (a loop's bug, a reward function or judge that fails) stays its own
            logger.warning(
                "agent loop %r failed on sample %s (dataset index %s): %s: %s",
                row["agent_name"],
                row["request_id"],
                row["index"],
                type(error).__name__,
                error,
            )
            return failed_output(error, self._pad_id)


def with_adapters(rows: list[dict[str, Any]], agent_loops: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, each with the LoRA adapter its sample uses in its ``lora_adapter`` column (``sample_adapter``: the
    router sends it with each turn, the trainer trains that adapter on it), when a row or agent entry names one."""
    if not any(ADAPTER_FIELD in spec for spec in agent_loops.values()) and not any(
        ADAPTER_FIELD in row for row in rows
    ):
        return rows
    return [{**row, ADAPTER_FIELD: sample_adapter(row, agent_loops[row["agent_name"]])} for row in rows]


def failed_output(error: BaseException, pad_token_id: int) -> tuple[AgentLoopOutput, SampleScore]:
    """The sample of a loop that raised: one pad token of prompt, no response (nothing to train on, no
    reward), end reason ``failed``; and its score, the error with its traceback in ``failure``."""
    failure = Failure(f"{type(error).__name__}: {error}", "".join(traceback.format_exception(error)))
    output = AgentLoopOutput(
        prompt_ids=[pad_token_id],
        response_ids=[],
        response_mask=[],
        response_logprobs=[],
        num_turns=1,
        end_reason="failed",
    )
    return output, SampleScore(failure=failure)
