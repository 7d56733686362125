"""Asynchronous training: the rollout servers generate later steps' batches while the FSDP ranks train.

``async_training.max_staleness`` = K ≥ 1 lets the batch of step s start at any policy version
v ≥ s - 1 - K (version = updates applied; step s trains version s - 1), so a background thread keeps
generating up to K steps ahead. With ``async_training.partial_rollout`` (the default) a weight push
interrupts the rollout in flight: the servers load the new weights and the routers continue each
request from the tokens it has, so one trajectory may hold tokens of several versions (each token's
version is in ``rollout_policy_versions``). Without it, a push waits for the rollout in flight to end
and every sample of a batch comes from one version (K = 1 is then slime's ``train_async``). Either way
no token lags the policy it trains by more than K versions.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from agentloop.batch import RolloutBatch, object_array
from trainer.rollout_correction import RolloutCorrection

logger = logging.getLogger(__name__)


def async_settings(config: DictConfig, correction: RolloutCorrection) -> tuple[int, bool, RolloutCorrection]:
    """``async_training.max_staleness`` and ``partial_rollout`` as this run can use them, and the rollout
    correction it trains with.

    Servers that sleep while the ranks train (``rollout.free_cache_engine=true``, the colocated layout)
    cannot generate meanwhile: the run then trains synchronously and says so. The ``sglang`` backend
    cannot interrupt its requests for a weight update yet: its pushes wait between rollouts. Samples of an older policy
    need the off-policy correction: without one configured, token-level truncated importance weights are
    turned on (decoupled PPO: clip against the re-scored old log-probs, weight by their ratio to the
    rollout's, truncated at ``rollout_is_threshold``).
    """
    max_staleness = int(config.async_training.max_staleness)
    partial_rollout = bool(config.async_training.partial_rollout)
    if max_staleness and partial_rollout and config.actor_rollout_ref.rollout.name == "sglang":
        warnings.warn(
            "async_training.partial_rollout=true: the sglang backend cannot interrupt its requests for a weight "
            "update yet, so this run's pushes wait between rollouts (as with partial_rollout=false)",
            stacklevel=2,
        )
        partial_rollout = False
    if max_staleness and config.actor_rollout_ref.rollout.free_cache_engine:
        warnings.warn(
            f"async_training.max_staleness={max_staleness} needs the rollout servers awake while the ranks train, but "
            "actor_rollout_ref.rollout.free_cache_engine=true puts them to sleep then (the colocated layout); this run "
            "trains synchronously. Set free_cache_engine=false (servers and ranks on their own devices) to overlap.",
            stacklevel=2,
        )
        return 0, partial_rollout, correction
    if max_staleness and not correction.uses_rollout_log_probs:
        logger.warning("async training: algorithm.rollout_correction.rollout_is=token (threshold %g) corrects for the "
                       "older policies that generated the samples", correction.rollout_is_threshold)
        correction = replace(correction, rollout_is="token")
    return max_staleness, partial_rollout, correction


class RolloutAhead:
    """Generates the batches of steps ``first..last`` on a daemon thread, at most ``max_staleness`` versions ahead.

    ``generate(step)`` rolls out step's rows (the manager's ``generate_sequences``); ``take(step)`` returns
    that batch; ``push(fn, version)`` loads new weights, interrupting the rollout in flight
    (``partial_rollout``) or waiting for it to end.
    """

    def __init__(
        self, generate: Callable[[int], RolloutBatch], first: int, last: int, max_staleness: int, version: int,
        timeout_s: float, partial_rollout: bool = True,
    ) -> None:
        self.max_staleness = max_staleness
        self.partial_rollout = partial_rollout
        self.version = version  # the policy version the servers hold
        self.timeout_s = timeout_s
        self._busy_s = 0.0
        self._rollout_start: float | None = None
        # held by a rollout, a validation, and a weight push that does not interrupt: one at a time on the servers
        self.lane = threading.Lock()
        self._changed = threading.Condition()
        self._ready: dict[int, RolloutBatch | BaseException] = {}
        self._stopping = False
        self._generate = generate
        self._thread = threading.Thread(target=self._run, args=(first, last), name="rollout-ahead", daemon=True)
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            with self._changed:
                # the batch of step s may come from version s - 1 - max_staleness at the oldest
                self._changed.wait_for(lambda: self._stopping or self.version >= step - 1 - self.max_staleness)
                if self._stopping:
                    return
            try:
                with self.lane:
                    version, start = self.version, time.perf_counter()
                    self._rollout_start = start
                    try:
                        batch = self._generate(step)
                    finally:
                        self._busy_s += time.perf_counter() - start
                        self._rollout_start = None
                batch.non_tensor_batch["policy_version"] = object_array([version] * len(batch))
                batch.meta_info["timing_s/rollout"] = time.perf_counter() - start
                result: RolloutBatch | BaseException = batch
            except BaseException as error:  # handed to the trainer, which raises it at take()
                result = error
            with self._changed:
                self._ready[step] = result
                self._changed.notify_all()
            if isinstance(result, BaseException):
                return

    def busy_s(self) -> float:
        """The servers' time in rollouts so far, the one in flight included."""
        start = self._rollout_start
        return self._busy_s + (time.perf_counter() - start if start is not None else 0.0)

    def take(self, step: int) -> RolloutBatch:
        """Step's batch, waiting for it (bounded by ``timeout_s``); re-raises the rollout's error."""
        with self._changed:
            if not self._changed.wait_for(lambda: step in self._ready or not self._thread.is_alive(), self.timeout_s):
                raise TimeoutError(
                    f"timed out after {self.timeout_s:.0f}s waiting for the rollout of step {step} "
                    "(actor_rollout_ref.rollout.generate_timeout_s)"
                )
            if step not in self._ready:
                raise RuntimeError(f"the rollout thread ended before producing step {step}'s batch")
            result = self._ready.pop(step)
        if isinstance(result, BaseException):
            raise result
        return result

    def push(self, load_weights: Callable[[], Any], version: int) -> float:
        """Load new weights now, interrupting the rollout in flight (``partial_rollout``), or between two
        rollouts; returns the seconds waited for the rollout in flight."""
        start = time.perf_counter()
        with contextlib.nullcontext() if self.partial_rollout else self.lane:
            waited = time.perf_counter() - start
            load_weights()
        with self._changed:
            self.version = version
            self._changed.notify_all()
        return waited

    def stop(self, timeout_s: float = 30.0) -> None:
        """Start no further rollout; wait up to ``timeout_s`` for the one in flight (the caller then shuts the
        servers and workers down, which ends it anyway)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("a rollout was still running %.0fs after the stop; shutting the servers down ends it", timeout_s)


def staleness_metrics(batch: RolloutBatch, trained_version: int, max_staleness: int) -> dict[str, float]:
    """How many policy versions the batch's samples lag the policy they train (mean, max, histogram), by each
    sample's oldest token (the batch's stamp where no token's version is known), and the share of samples
    whose tokens come from more than one version (``async/partial_share``)."""
    versions = batch.batch["rollout_policy_versions"]
    known = versions >= 0
    stamped = torch.tensor([int(version) for version in batch.non_tensor_batch["policy_version"]])
    oldest = torch.where(known.any(-1), versions.masked_fill(~known, torch.iinfo(versions.dtype).max).min(-1).values, stamped)
    newest = torch.where(known.any(-1), versions.max(-1).values, stamped)
    lags = trained_version - oldest
    if int(lags.max()) > max_staleness:  # the version gate makes this impossible; a bug if it happens
        raise RuntimeError(f"a sample lags {int(lags.max())} policy versions, more than async_training.max_staleness={max_staleness}")
    metrics = {
        "async/staleness/mean": float(lags.float().mean()),
        "async/staleness/max": float(lags.max()),
        "async/partial_share": float((newest != oldest).float().mean()),
    }
    for lag in range(max_staleness + 1):
        metrics[f"async/staleness_histogram/{lag}"] = float((lags == lag).sum())
    return metrics
