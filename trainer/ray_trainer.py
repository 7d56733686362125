"""The trainer of ``python -m trainer.main_ppo``: ``RayPPOTrainer`` owns the rollout manager and the FSDP ranks.

One step (``RayPPOTrainer.step``, then ``learn``): the run's rollout source (``trainer.rollout_source``, chosen once
as it fits: synchronous, or a stream of groups generated ahead for an async run) gives the batch: rows →
``AgentLoopManager.generate_sequences`` (rollouts, rewards in ``rm_scores``; with ``algorithm.filter_groups``, more
generation batches until enough groups with a signal) → servers sleep (``rollout.free_cache_engine``) → plan where the old log-probs come
from (``StepPlan``) → score: old log-probs (unless the one update step scores them itself), reference
log-probs, overlong penalty and KL in the reward if asked, rollout correction (``algorithm.rollout_correction``) →
advantages (GRPO, or GAE on the critic's values) → overlong filtering if asked → updates: critic, then policy → full
weights pushed to every rollout server → servers wake.
Checkpoints every ``trainer.save_freq`` steps; ``trainer.resume_mode=auto`` continues from the newest one.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import psutil
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from tqdm import tqdm
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.batch import RolloutBatch, object_array
from agentloop.cluster import start_ray
from agentloop.metrics import spread
from agentloop.preflight import check_job
from agentloop.preparation import check_paths
from agentloop.registry import ADAPTER_FIELD
from agentloop.tools.toolset import load_tool_set
from agentloop.waiting import wait_for
from trainer import algorithms, checkpoint
from trainer.config_checks import check_config, warn_ignored_keys, world_size
from trainer.data import BatchSampler, load_dataset
from trainer.lora import LoraSettings, adapter_indices
from trainer.fsdp_workers import join_workers, launch_workers, push_weights, rank_gpus
from trainer.micro_batches import split_trajectories, trajectory_sizes
from trainer.async_training import staleness_metrics
from trainer.overlong import mask_length_ended
from trainer.rollout_correction import correct_batch, old_log_probs_in_update
from trainer.rollout_dump import RolloutDumps
from trainer.rollout_source import RolloutSource, StepShape, StreamedRollouts, SynchronousRollouts
from trainer.settings import (
    AlgorithmSettings,
    RunSettings,
    async_settings,
    group_filter,
    overlong_buffer,
    rank_settings,
    rollout_correction,
)
from trainer.tracking import Tracking, plot, summarize
from trainer.trainable import EXTREMES


# start-up phases are single blocking calls: the bar names each one and counts them
STARTUP_BAR = "{desc}: {n_fmt}/{total_fmt} [{elapsed}]"


class RayPPOTrainer:
    """Owns the rollout manager and the FSDP ranks, and runs the training loop."""

    def __init__(self, config: DictConfig) -> None:
        check_config(config)
        warn_ignored_keys(config)
        config = config.copy()
        OmegaConf.resolve(config)  # interpolations only; what they name was built by prepare() (main_ppo runs it)
        check_paths(config)
        LoraSettings.from_config(config).check_model(config.actor_rollout_ref.model.path)  # the model is built now
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        # data errors surface before any server starts
        self.rows = self._load(config.data.train_files)
        self.val_rows = self._load(config.data.val_files) if config.data.val_files else []
        check_job(config, {"train": self.rows, "validation": self.val_rows})
        self.group_filter = group_filter(config)  # dynamic sampling (None: off)
        self.overlong = overlong_buffer(config)  # the overlong penalty (None: off)
        # rows per generation batch: verl's data.gen_batch_size (dynamic sampling), else the training batch's
        generation = "gen_batch_size" if config.data.gen_batch_size is not None else "train_batch_size"
        self.sampler = BatchSampler(
            len(self.rows),
            int(config.data[generation]),
            shuffle=config.data.shuffle,
            seed=config.data.seed,
            size_key=f"data.{generation}",
        )
        self.total_steps = int(
            config.trainer.total_training_steps or self.sampler.batches_per_epoch * int(config.trainer.total_epochs)
        )
        self.world_size = world_size(config)
        start_ray(config)  # unless a caller started it (``main_ppo.run`` does, beside the imports)
        self.ranks = rank_settings(config)  # the FSDP ranks'
        rank_gpus(
            self.ranks.device, self.world_size
        )  # a trainer.device the cluster lacks fails here, before any server starts
        self.output_dir = Path(config.trainer.default_local_dir)
        self.run_settings = RunSettings.from_config(config)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.algorithm = AlgorithmSettings.from_config(config)
        self.kl_coef = self.algorithm.kl_ctrl.kl_coef  # moves with kl_ctrl.type=adaptive; checkpointed
        self.async_training, self.correction = async_settings(config).for_run(
            bool(config.actor_rollout_ref.rollout.free_cache_engine), rollout_correction(config)
        )
        self.rollouts: RolloutSource | None = None  # this run's (chosen as it fits)
        self.dumps = (
            RolloutDumps(config.trainer.rollout_data_dir, self.tokenizer) if config.trainer.rollout_data_dir else None
        )

        self.manager, self.workers = self._start_services()
        self.config = self.manager.config  # with absolute paths, for every process
        # from the command's start (imports and Ray included) to servers, workers and ranks ready
        self.startup_s = time.time() - psutil.Process().create_time()

    def _start_services(self) -> tuple[AgentLoopManager, list[Any]]:
        """The ranks load while the servers and workers start; each failure leaves nothing running."""
        config = self.config
        ranks, loading = launch_workers(self.ranks, self.world_size, self.total_steps)
        with tqdm(total=2, desc="starting rollout servers and agent-loop workers", bar_format=STARTUP_BAR) as startup:
            try:
                manager = AgentLoopManager(config)
            except BaseException:
                for rank in ranks:
                    ray.kill(rank)
                raise
            startup.update()
            startup.set_description_str(f"starting {self.world_size} FSDP ranks")
            try:
                workers = join_workers(ranks, loading, float(config.trainer.startup_timeout_s))
            except BaseException:
                manager.shutdown()
                raise
            startup.update()
        return manager, workers

    def _load(self, files: Any) -> list[dict[str, Any]]:
        data = self.config.data
        return load_dataset(
            list(files) if not isinstance(files, str) else files,
            prompt_length=self._prompt_length_measure() if data.filter_overlong_prompts else None,
            max_prompt_length=int(data.max_prompt_length),
            filter_overlong_prompts=bool(data.filter_overlong_prompts),
            prompt_key=str(data.prompt_key),
        )

    def _prompt_length_measure(self) -> Callable[[dict[str, Any]], int]:
        """A row's prompt length as a loop renders it: with the tool schemas whenever a tool config is set."""
        tool_config = self.config.actor_rollout_ref.rollout.multi_turn.tool_config_path
        template_kwargs = dict(self.config.data.apply_chat_template_kwargs or {})

        @functools.cache  # once, at the first row: a missing data file is reported before a bad tool config
        def tools() -> list[dict[str, Any]] | None:
            return (load_tool_set(tool_config).schemas or None) if tool_config else None

        def prompt_length(row: dict[str, Any]) -> int:
            return len(
                self.tokenizer.apply_chat_template(
                    row["prompt"],
                    tools=tools(),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    **template_kwargs,
                )
            )

        return prompt_length

    def _wait(self, refs: list[Any], what: str) -> list[Any]:
        return wait_for(refs, float(self.config.trainer.step_timeout_s), what)

    def _on_ranks(self, method: str, batch: TensorDict, **kwargs: Any) -> list[Any]:
        """``method`` on every rank, each with as many whole trajectories (all their rows) in batch order."""
        shards = split_trajectories(batch, len(trajectory_sizes(batch)) // self.world_size)
        return self._wait(
            [getattr(w, method).remote(s, **kwargs) for w, s in zip(self.workers, shards)],
            f"{method} on the FSDP ranks",
        )

    def _push_weights(self, version: int) -> float:
        start = time.perf_counter()
        push_weights(self.workers, self.manager, float(self.config.trainer.step_timeout_s), version)
        return time.perf_counter() - start

    def step(self, step: int) -> dict[str, float]:
        """The run's next rollout (``self.rollouts``), update and weight push; returns the step's metrics."""
        start, servers_idle_share = time.perf_counter(), self.manager.servers_idle_share_from_now()
        rollout, waited_s, sampling = self.rollouts.next(step)
        metrics = (
            self.learn(step, rollout, start, waited_s) if rollout is not None else self._skip(step, start, waited_s)
        )
        return {**metrics, **sampling, "perf/idle_share/servers": servers_idle_share()}

    def _rollout_source(self, batches: Iterator[list[int]], version: int) -> RolloutSource:
        """Synchronous steps, or, with ``async_training.max_staleness``, a stream of groups generated ahead."""
        config = self.config
        steps = StepShape(
            int(config.data.train_batch_size),
            self.world_size,
            float(config.actor_rollout_ref.rollout.generate_timeout_s),
        )
        common = (steps, self.manager, self.rows, self.sampler, batches, self.group_filter)
        if not self.async_training.max_staleness:
            return SynchronousRollouts(*common, bool(config.actor_rollout_ref.rollout.free_cache_engine))
        return StreamedRollouts(*common, self.async_training, version)

    def _skip(self, step: int, start: float, waited_s: float) -> dict[str, float]:
        """A step that dynamic sampling left nothing to train: the policy stays as it is, and is pushed as version
        ``step`` all the same (versions count steps); returns the step's timings."""
        warnings.warn(
            f"step {step}: dynamic sampling (algorithm.filter_groups) left no group to train; the policy is not updated "
            "this step",
            stacklevel=2,
        )
        push_s, waited_s = self.rollouts.push(step, self._push_weights, waited_s)
        return {"timing_s/gen": waited_s, "timing_s/weight_push": push_s, "timing_s/step": time.perf_counter() - start}

    def learn(self, step: int, rollout: RolloutBatch, start: float, waited_s: float) -> dict[str, float]:
        """Train policy version ``step - 1`` on ``rollout`` and push the result; returns the step's metrics.

        ``start``: when the step began; ``waited_s``: how long the ranks waited for the batch (the whole rollout
        in a synchronous step, the wait for the stream's finished groups in an asynchronous one).
        """
        if "policy_version" not in rollout.non_tensor_batch:  # synchronous: generated by the policy about to train
            rollout.non_tensor_batch["policy_version"] = object_array([step - 1] * len(rollout))
        # the overlong penalty joins the score itself (verl's token-level scores): metrics, dumps and estimators see it
        metrics = self.overlong.shape(rollout) if self.overlong is not None else {}
        plan = self._plan(step, rollout)
        batch = rollout.batch.clone()
        if self.ranks.model.lora is not None and self.ranks.model.lora.several:  # which adapter trains on each row
            names = rollout.non_tensor_batch.get(ADAPTER_FIELD)
            batch["adapter_index"] = adapter_indices(self.ranks.model.lora, names, len(batch))
        rewards, scoring = self._score(plan, batch)
        metrics.update(scoring)
        metrics.update(self._advantages(rollout, batch, rewards))
        if self.algorithm.overlong_filtering:  # after the advantages: the group statistics still count them
            metrics.update(mask_length_ended(rollout, batch))
        metrics.update(self._update(plan, batch))
        timing = {"gen": waited_s, "train": time.perf_counter() - start - waited_s}  # train: scoring passes and updates
        timing["weight_push"], waited_s = self.rollouts.push(step, self._push_weights, waited_s)
        if self.dumps is not None:
            arrays = {
                key: batch[key]
                for key in ("old_log_probs", "ref_log_probs", "rollout_is_weights", "advantages")
                if key in batch.keys()
            }
            previous_dump_s = self.dumps.submit(step, rollout, **arrays)
            if previous_dump_s is not None:  # the previous step's dump, written while this step ran
                timing["rollout_dump"] = previous_dump_s
        metrics.update(
            {
                **batch_metrics(batch, rewards),
                **rollout.meta_info,
                **staleness_metrics(rollout, step - 1, self.async_training.max_staleness),
                **{f"timing_s/{key}": value for key, value in timing.items()},
                "timing_s/step": time.perf_counter() - start,
                "perf/idle_share/ranks": waited_s / (time.perf_counter() - start),
            }
        )
        return metrics

    def _plan(self, step: int, rollout: RolloutBatch) -> StepPlan:
        trains_actor = step >= int(
            self.config.trainer.critic_warmup
        )  # verl's rule: the actor starts at step critic_warmup
        lora = self.ranks.model.lora
        # the update's passes skip a frozen adapter's rows: their old log-probs come from the scoring pass
        frozen = lora is not None and not all(spec.trainable for spec in lora.adapters)
        if self.correction.bypass_mode:
            old_log_probs = "rollout"
        elif (
            trains_actor
            and not frozen
            and old_log_probs_in_update(
                self.ranks.actor.update,
                self.ranks.samples_per_prompt,
                self.algorithm.use_kl_in_reward,
                self.correction,
                rollout.num_trajectories,
            )
        ):
            old_log_probs = "update"
        else:
            old_log_probs = "scored"
        logged = _has_rollout_log_probs(
            rollout, required=self.correction.uses_rollout_log_probs
        )  # else no rollout_corr/*
        return StepPlan(old_log_probs, logged, trains_actor)

    def _score(self, plan: StepPlan, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        """The old log-probs (unless the update scores them), the reference's, the KL penalty in the reward and
        the decoupled rollout correction; returns the token rewards and the metrics of the penalty and correction."""
        if plan.old_log_probs == "rollout":  # bypass mode: two policies, the rollout's log-probs are the old ones
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif plan.old_log_probs == "scored":
            batch["old_log_probs"] = torch.cat(self._on_ranks("compute_log_prob", batch))
        if self.ranks.ref is not None:
            batch["ref_log_probs"] = torch.cat(self._on_ranks("compute_log_prob", batch, reference=True))
        rewards, metrics = batch["rm_scores"], {}
        if self.algorithm.use_kl_in_reward:
            penalty, metrics = self._kl_in_reward(batch)
            rewards = rewards - penalty
        # (bypass mode corrects on the ranks, against the current policy; an update that scores the old log-probs
        # corrects with them, row by row)
        if plan.old_log_probs == "scored" and plan.corrects:
            metrics.update(correct_batch(batch, self.correction))  # importance weights; rejection narrows the mask
        return rewards, metrics

    def _kl_in_reward(self, batch: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        """``algorithm.kl_penalty`` of the old log-probs to the reference's, times the current coefficient (which
        then moves if ``kl_ctrl.type=adaptive``), and its metrics."""
        mask = batch["response_mask"].float()
        kl = algorithms.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.algorithm.kl_penalty) * mask
        penalty = self.kl_coef * kl
        observed_kl = float(algorithms.masked_mean(kl, mask, dim=-1).mean())  # per sequence, then over the batch
        metrics = {"actor/reward_kl_penalty": observed_kl, "actor/reward_kl_penalty_coeff": self.kl_coef}
        control = self.algorithm.kl_ctrl
        if control.type == "adaptive":
            self.kl_coef = algorithms.adaptive_kl_coef(
                self.kl_coef,
                observed_kl,
                control.target_kl,
                control.horizon,
                len(trajectory_sizes(batch)),
            )
        return penalty, metrics

    def _advantages(self, rollout: RolloutBatch, batch: TensorDict, rewards: torch.Tensor) -> dict[str, float]:
        """``algorithm.adv_estimator``: GRPO's group-normalised outcome advantages (one per trajectory, on all its rows);
                or, on the token rewards with each turn's own reward on its last model token (``turn_token_rewards``), GAE on
                the critic's values (along each trajectory's segments), turn-level GRPO or GiGPO (one advantage per turn). Returns
        the critic's metrics (GAE)."""
        algorithm, mask, segment_index = self.algorithm, batch["response_mask"].float(), batch["segment_index"]
        estimator, gamma, by_std = algorithm.adv_estimator, algorithm.gamma, algorithm.norm_adv_by_std_in_grpo
        if estimator == "grpo":
            batch["advantages"], _ = algorithms.grpo_outcome_advantage(
                rewards, mask, grpo_groups(rollout), by_std, segment_index=segment_index
            )
            return {}
        rewards = algorithms.turn_token_rewards(rewards, batch["turn_rewards"], mask, segment_index)
        if estimator == "gae":
            batch["values"] = torch.cat(self._on_ranks("compute_values", batch))
            batch["advantages"], batch["returns"] = algorithms.gae_advantage_return(
                rewards, batch["values"], mask, gamma, algorithm.lam, segment_index
            )
            return {
                "critic/values/mean": float(algorithms.masked_mean(batch["values"], mask)),
                "critic/returns/mean": float(algorithms.masked_mean(batch["returns"], mask)),
            }
        if estimator == "turn_grpo":
            batch["advantages"], _ = algorithms.turn_grpo_advantage(
                rewards,
                batch["turn_index"],
                mask,
                grpo_groups(rollout),
                gamma,
                algorithm.turn_normalize,
                by_std,
                segment_index=segment_index,
            )
        else:
            batch["advantages"], _ = algorithms.gigpo_advantage(
                rewards,
                batch["turn_index"],
                mask,
                grpo_groups(rollout),
                turn_states(rollout),
                algorithm.gigpo_step_weight,
                gamma,
                by_std,
                segment_index=segment_index,
                episode_normalize=algorithm.gigpo_episode_normalize,
                first_turn_step_advantage=algorithm.gigpo_first_turn_step_advantage,
            )
        return {}

    def _update(self, plan: StepPlan, batch: TensorDict) -> dict[str, float]:
        """The critic's update (GAE), then the policy's (from step ``critic_warmup`` on); their metrics."""
        metrics: dict[str, float] = {}
        if self.algorithm.adv_estimator == "gae":
            metrics.update(_mean_over_ranks(self._on_ranks("update_critic", batch)))
        if plan.old_log_probs == "update":
            updates = self._on_ranks("update_policy_scoring_old", batch, correction=self.correction)
            batch["old_log_probs"] = torch.cat([old_log_probs for _, old_log_probs in updates])
            metrics.update(
                correct_batch(batch, self.correction) if plan.corrects else {}
            )  # the weights the loss used, for metrics and dumps
            metrics.update(_mean_over_ranks([update for update, _ in updates]))
        elif plan.trains_actor:
            metrics.update(_mean_over_ranks(self._on_ranks("update_policy", batch, correction=self.correction)))
        return metrics

    def validate(self) -> dict[str, float]:
        """Score ``data.val_files`` with ``rollout.val_kwargs``: mean score (per trajectory) overall and per data source."""
        start = time.perf_counter()
        output = self.manager.generate_sequences(self.val_rows, validate=True)
        scores = algorithms.trajectory_sums(output.batch["rm_scores"].sum(-1), output.batch["segment_index"])
        last = output.last_segments()
        sources = np.asarray(
            [row or "unknown" for row in output.non_tensor_batch.get("data_source", [None] * len(output))]
        )[last]
        metrics = {"val/score/mean": float(scores.mean()), "timing_s/validation": time.perf_counter() - start}
        for source in sorted(set(sources)):
            metrics[f"val/score/{source}"] = float(scores[torch.from_numpy(sources == source)].mean())
        return metrics

    def save_checkpoint(self, step: int) -> Path:
        """``global_step_N/``: sharded workers state, the policy as a Hugging Face checkpoint, the data position."""
        return checkpoint.save_checkpoint(
            self.output_dir,
            step,
            lambda shards, hf: self._wait(
                [w.save_checkpoint.remote(str(shards), str(hf)) for w in self.workers], "the checkpoint save"
            ),
            self.tokenizer,
            {**self._data_state(), "kl_coef": self.kl_coef},
            int(self.config.trainer.max_actor_ckpt_to_keep or 0),
        )

    def _data_state(self) -> dict[str, Any]:
        """Where the data continues: past the batches handed out (a synchronous step may take several: dynamic
        sampling), with the rows of those that were not trained yet (an async run's stream generates ahead) to replay
        first."""
        return self.rollouts.data_state()

    def resume(self) -> int:
        """Restore the checkpoint ``trainer.resume_mode`` points at; return its step (0: start fresh)."""
        directory = checkpoint.checkpoint_to_resume(self.run_settings, self.output_dir)
        if directory is None:
            # the servers serve an adapter only once it is pushed: several adapters, or one loaded from a path (else
            # the first rollouts would sample from the base model)
            lora = self.ranks.model.lora
            if lora is not None and (lora.several or any(adapter.path for adapter in lora.adapters)):
                self._push_weights(0)
            return 0
        state = checkpoint.read_trainer_state(directory)
        self._wait(
            [w.load_checkpoint.remote(str(directory / checkpoint.WORKERS)) for w in self.workers], "the checkpoint load"
        )
        self.sampler.restore(state, partial_replay=self.group_filter is not None)
        self.kl_coef = float(state.get("kl_coef", self.kl_coef))
        # the servers start from the base model: give them the restored policy
        self._push_weights(int(state["step"]))
        print(f"resumed from {directory} at step {state['step']}")
        return int(state["step"])

    def fit(self) -> list[dict[str, Any]]:
        """Train until ``trainer.total_training_steps``; return every logged line (metrics by step)."""
        trainer = self.config.trainer
        done = self.resume()
        if self.dumps is not None:
            self.dumps.drop_after(done)
        progress = tqdm(total=self.total_steps, initial=done, desc="training steps", dynamic_ncols=True)
        tracking = Tracking(self.run_settings, self.output_dir, progress.write, done, run_config=self.config)
        try:
            startup = {"timing_s/startup": self.startup_s}  # on the first line this run logs
            if self.val_rows and trainer.val_before_train and done == 0:
                tracking.log({**startup, **self._validate_showing(progress)}, step=0)
                startup = {}
            # dynamic sampling draws rows beyond one batch per step: on into later epochs as far as it takes
            batches = self.sampler.batches(None if self.group_filter is not None else self.total_steps - done)
            self.rollouts = self._rollout_source(batches, done)
            for step in range(done + 1, self.total_steps + 1):
                metrics = {
                    **startup,
                    **self.step(step),
                }
                startup = {}
                last = step == self.total_steps
                if self.val_rows and int(trainer.test_freq) > 0 and (step % int(trainer.test_freq) == 0 or last):
                    metrics.update(self._validate_showing(progress))  # beside the stream's rollouts, if any
                # logged first: a run killed between the two resumes from the previous checkpoint and
                # drops this line, rather than resuming after a step it never logged
                tracking.log(metrics, step)
                if int(trainer.save_freq) > 0 and (step % int(trainer.save_freq) == 0 or last):
                    self.save_checkpoint(step)
                progress.update(1)
        finally:
            if self.rollouts is not None:
                self.rollouts.stop()
            progress.close()
            tracking.close()
            if self.dumps is not None:
                self.dumps.close()
        if tracking.history:
            summarize(tracking.history, plot(tracking.history, self.output_dir / "training_curves.png"))
        return tracking.history

    def _validate_showing(self, progress: tqdm) -> dict[str, float]:
        progress.set_description(f"validating on {len(self.val_rows)} rows")
        metrics = self.validate()
        progress.set_description("training steps")
        return metrics

    def shutdown(self, rank_timeout_s: float = 60) -> None:
        """Release ranks and servers, best effort (never hiding the error that ended the run); a rank still
        in a collective its peer left (an interrupted step) is killed after ``rank_timeout_s``."""
        try:
            wait_for(
                [worker.shutdown.remote() for worker in self.workers], rank_timeout_s, "the FSDP ranks to shut down"
            )
        except Exception as error:  # a rank stuck in a collective: killing it is all that is left
            print(f"FSDP ranks did not shut down cleanly ({error}); killing them")
        for worker in self.workers:
            ray.kill(worker)
        self.manager.shutdown()


@dataclass(frozen=True)
class StepPlan:
    """Where a training step's old log-probs come from, and whether it corrects for the rollout policy."""

    # "rollout": bypass mode, the rollout's own; "scored": a scoring pass on the ranks before the advantages;
    # "update": the one update step's own forward passes (``old_log_probs_in_update``)
    old_log_probs: str
    corrects: bool  # every trajectory has rollout log-probs: rollout_corr/* weights and metrics (if configured)
    trains_actor: bool  # the step is at or past trainer.critic_warmup


def batch_metrics(batch: TensorDict, rewards: torch.Tensor) -> dict[str, float]:
    """Scores and rewards (per trajectory), advantages (per model token) and lengths (per row: a segment's context and
    response) of a trained batch, as verl names them; ``training/rows``, the rows trained (one per segment)."""
    width, mask, segment_index = batch["prompts"].shape[1], batch["response_mask"].bool(), batch["segment_index"]
    prompt_length = batch["attention_mask"][:, :width].sum(-1).float()
    response_length = batch["attention_mask"][:, width:].sum(-1).float()
    return {
        **spread("critic/score", algorithms.trajectory_sums(batch["rm_scores"].sum(-1), segment_index)),
        **spread("critic/rewards", algorithms.trajectory_sums(rewards.sum(-1), segment_index)),
        **spread("critic/advantages", batch["advantages"][mask]),
        **spread("response_length", response_length),
        "response_length/clip_ratio": float((response_length >= batch["responses"].shape[1]).float().mean()),
        **spread("prompt_length", prompt_length),
        "prompt_length/clip_ratio": float((prompt_length >= width).float().mean()),
        "training/rows": float(len(batch)),
    }


def grpo_groups(rollout: RolloutBatch) -> list[str]:
    """Each trajectory's GRPO group: its ``uid``, except that a failed trajectory leaves its group (a group of one,
    advantage 0) so the others are normalised among themselves."""
    last = rollout.last_segments()
    uids, failures = rollout.non_tensor_batch["uid"][last], rollout.non_tensor_batch["failure"][last]
    return [f"{uid}/failed/{i}" if failure is not None else uid for i, (uid, failure) in enumerate(zip(uids, failures))]


def turn_states(rollout: RolloutBatch) -> list[list[str | None]]:
    """Each trajectory's turns' states (``TurnRecord.state_key``), for GiGPO's step groups."""
    return [
        [turn.state_key for turn in turns or []] for turns in rollout.non_tensor_batch["turns"][rollout.last_segments()]
    ]


def _has_rollout_log_probs(rollout: RolloutBatch, required: bool) -> bool:
    """Whether every sample has its rollout log-probs (a loop may return none, as verl allows); an error if ``required``."""
    fields = rollout.non_tensor_batch
    missing = sorted(
        {str(name) for name, missing in zip(fields["agent_name"], fields["rollout_log_probs_missing"]) if missing}
    )
    if missing and required:
        raise ValueError(
            f"agent loops {missing} returned no response_logprobs, which algorithm.rollout_correction (or bypass_mode) "
            "needs: return the engine's log_probs from those loops, or turn the correction off"
        )
    return not missing


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    # a statistic a rank could not take (e.g. importance-weight extremes on a slice without model tokens) is
    # missing from its dict: combine over the ranks that have it (extremes by max/min, the rest by mean)
    keys = dict.fromkeys(key for metrics in per_rank for key in metrics)
    return {
        key: float(EXTREMES.get(key[-4:], np.mean)([metrics[key] for metrics in per_rank if key in metrics]))
        for key in keys
    }
