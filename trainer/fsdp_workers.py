"""The trainer's models as FSDP2-sharded Ray actors: one process per rank in a ``torch.distributed`` group.

gloo on CPU, NCCL on GPU. Every rank hosts its shard of the policy and, when the config asks for them,
of the frozen reference policy (KL) and of the critic (GAE): colocating the three on the same ranks
needs no extra processes or process groups. Parameters are sharded with ``fully_shard`` per decoder
layer, then the root; each rank works on its slice of the batch (whole trajectories: as many as every other rank,
in as many forward passes, ``trainer.micro_batches``) and FSDP reduces the gradients.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
from pathlib import Path
import tempfile
from typing import TYPE_CHECKING, Any

import psutil
import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForTokenClassification

from agentloop.allocator import keep_freed_memory, release_freed_memory
from agentloop.cluster import actor_resources
from agentloop.models.loading import is_vision_language, model_class
from agentloop.server.adapters import PackedAdapter
from agentloop.server.collective import WeightSource
from agentloop.server.weights import PackedWeights
from agentloop.waiting import wait_for
from trainer import algorithms, lora
from trainer.rollout_correction import RolloutCorrection, correct, correct_batch
from trainer.micro_batches import is_stand_in, trajectory_sizes
from trainer.rank_settings import (
    ActorSettings,
    CriticSettings,
    FSDPSettings,
    ModelSettings,
    RankSettings,
    UpdateSettings,
)
from trainer.sharding import load_sharded
from trainer.trainable import Trainable
from trainer.vision import attended_columns, forward_logits

if TYPE_CHECKING:
    from agentloop import AgentLoopManager


def response_log_probs(
    model: torch.nn.Module, batch: TensorDict, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the response tokens under ``model`` (logits / temperature), ``[b, R]`` (0 on the
    columns of right padding in every row, which the forward pass skips)."""
    responses = batch["responses"]
    width = held_response_columns(batch)
    logits = forward_logits(model, batch, last=width + 1)[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses[:, :width].unsqueeze(-1)).squeeze(-1)
    padding = (0, responses.shape[1] - width)
    return F.pad(log_probs, padding), F.pad(algorithms.entropy_from_logits(logits), padding)


def held_response_columns(batch: TensorDict) -> int:
    """How many response columns some row of ``batch`` holds (the forward pass ends at the last, ``attended_columns``)."""
    mask = batch["attention_mask"]
    return batch["responses"].shape[1] - (mask.shape[1] - attended_columns(mask)[1])


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether training mode changes the model's forward pass: a dropout module, or a dropout rate in its config."""
    config = model.config
    rates = [
        getattr(section, key, 0.0) or 0.0
        for section in (config, config.get_text_config())
        for key in (
            "attention_dropout",
            "hidden_dropout",
            "hidden_dropout_prob",
            "dropout",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
        )
    ]
    return any(float(rate) > 0 for rate in rates) or any(
        isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules()
    )


def response_values(critic: torch.nn.Module, batch: TensorDict) -> torch.Tensor:
    """The critic's value of the state before each response token, ``[b, R]`` (0 on columns of right padding in every row)."""
    width = held_response_columns(batch)
    values = forward_logits(critic, batch)[:, -width - 1 : -1, 0].float()
    return F.pad(values, (0, batch["responses"].shape[1] - width))


def policy_gradient_loss(
    micro: TensorDict, log_probs: torch.Tensor, actor: ActorSettings, correction: RolloutCorrection
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The policy-gradient term of ``actor``'s loss, the mask the other terms use, and its metrics.

    Decoupled mode: PPO against the re-scored ``old_log_probs``, times ``rollout_is_weights`` when the batch
    has them. Bypass mode: ``old_log_probs`` are the rollout's; the correction runs here against the current
    policy, and ``loss_type`` picks PPO (whose ratio already is the importance weight, so the weights are
    only reported, as in verl) or REINFORCE times the weights. Rejection sampling narrows the mask in both.
    """
    mask, stats = micro["response_mask"].float(), {}
    weights = micro.get("rollout_is_weights", None)
    if correction.bypass_mode:
        weights, mask, stats = correct(log_probs.detach(), micro["old_log_probs"], mask, correction)
    common = dict(loss_agg_mode=actor.update.loss_agg_mode, loss_scale_factor=actor.loss_scale_factor)
    if correction.bypass_mode and correction.loss_type == "reinforce":
        pg_loss, pg_stats = algorithms.reinforce_policy_loss(
            micro["old_log_probs"], log_probs, micro["advantages"], mask, importance_weights=weights, **common
        )
    else:
        pg_loss, pg_stats = algorithms.ppo_policy_loss(
            micro["old_log_probs"],
            log_probs,
            micro["advantages"],
            mask,
            actor.clip_ratio_low,
            actor.clip_ratio_high,
            actor.clip_ratio_c,
            importance_weights=None if correction.bypass_mode else weights,
            **common,
        )
    return pg_loss, mask, {**stats, **{f"actor/{key}": value for key, value in pg_stats.items()}}


@ray.remote
class FSDPWorker(WeightSource):
    """One rank of the policy (plus reference policy and critic when configured).

    Two phases, because rank 0's own node and port must be known before the group forms: construct
    every rank, ask rank 0 for ``rendezvous_address()``, then call ``init_group`` with it on all of them.
    ``settings`` are the ranks' (``trainer.settings.rank_settings``); ``total_steps`` sizes the LR schedules.
    """

    def __init__(self, settings: RankSettings, rank: int, world_size: int, total_steps: int) -> None:
        self.settings, self.rank, self.world_size, self.total_steps = settings, rank, world_size, total_steps
        keep_freed_memory()  # every step frees and reallocates the same activations

    def rendezvous_address(self) -> tuple[str, int]:
        """This process's node address and a free port on it (asked of rank 0)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def init_group(self, rendezvous: tuple[str, int]) -> None:
        """Join the process group at rank 0's ``rendezvous_address()`` and load this rank's shards of the models."""
        settings = self.settings
        self._join_process_group(rendezvous)
        self.actor, self.temperature = settings.actor, settings.temperature
        torch.manual_seed(0)
        model = settings.model
        self.lora = model.lora  # the adapter the policy trains (None: full-weight training)
        self.policy = Trainable(
            self._sharded(
                model_class(model.path),
                model,
                settings.actor.fsdp,
                adapt=self.lora.adapt if self.lora is not None else None,
            ),
            settings.actor.optim,
            self.total_steps,
            "actor",
            self.device,
            settings.actor.fsdp.optimizer_offload,
            adapters=self.lora if self.lora is not None and self.lora.several else None,
        )
        self.policy_has_dropout = has_dropout(self.policy.model)  # its training forward pass is not its scoring one
        self.ref = None
        if settings.ref is not None and self.lora is not None:
            self.ref = self.policy.model  # scored with its adapter disabled: the base model
        elif settings.ref is not None:
            ref = settings.ref.model
            self.ref = self._sharded(model_class(ref.path), ref, settings.ref.fsdp).eval().requires_grad_(False)
        self.critic = self._load_critic(settings.critic) if settings.critic is not None else None

    def _join_process_group(self, rendezvous: tuple[str, int]) -> None:
        master_addr, master_port = rendezvous
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        cuda = bool(ray.get_gpu_ids())  # start_workers gave this rank a GPU
        # a collective waits at most as long as the trainer waits for a step
        timeout = datetime.timedelta(seconds=self.settings.step_timeout_s)
        dist.init_process_group("nccl" if cuda else "gloo", rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.device = "cuda" if cuda else "cpu"
        if not cuda:  # Ray gives an actor without CPUs one thread: the ranks share the node's cores instead
            ranks_here = min(self.world_size, self.settings.ranks_per_node)
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_here))
        self.mesh = init_device_mesh(self.device, (self.world_size,))

    def _load_critic(self, settings: CriticSettings) -> Trainable:
        if is_vision_language(settings.model.path):
            raise ValueError(
                "algorithm.adv_estimator=gae needs a critic, and a vision-language critic is not supported yet: use grpo"
            )
        # no dropout on the value head: the old values it is clipped against come from eval mode
        critic_config = AutoConfig.from_pretrained(settings.model.path, num_labels=1)
        critic_config.classifier_dropout = 0.0  # (not a Qwen3Config field: from_pretrained would drop it)
        critic = self._sharded(AutoModelForTokenClassification, settings.model, settings.fsdp, config=critic_config)
        return Trainable(
            critic, settings.optim, self.total_steps, "critic", self.device, settings.fsdp.optimizer_offload
        )

    def _sharded(self, auto_class: Any, model: ModelSettings, fsdp: FSDPSettings, **kwargs: Any) -> torch.nn.Module:
        return load_sharded(auto_class, model.path, self.mesh, fsdp, model.enable_gradient_checkpointing, **kwargs)

    @torch.no_grad()
    def compute_log_prob(self, batch: TensorDict, reference: bool = False) -> torch.Tensor:
        """This rank's slice re-scored by the current policy (old log-probs), or by the reference policy."""
        model = self.ref if reference else self.policy.model
        if model is None:
            raise RuntimeError(
                "no reference policy on this worker: set actor.use_kl_loss or algorithm.use_kl_in_reward"
            )
        model.eval()
        batching = self.settings.ref.batching if reference else self.settings.log_prob_batching

        def score(micro: TensorDict) -> torch.Tensor:
            return response_log_probs(model, micro, self.temperature)[0]

        if not reference and self.lora is not None and self.lora.several:  # each row under its own adapter
            scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
            for index, spec in enumerate(self.lora.adapters):
                self.lora.activate(model, spec.name)
                rows = (batch["adapter_index"] == index).nonzero().flatten().tolist()
                scores[rows] = batching.score(batch, self.device, score, rows)[rows]
            return scores
        with model.disable_adapter() if reference and self.lora is not None else contextlib.nullcontext():
            return batching.score(batch, self.device, score)

    @torch.no_grad()
    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        """The critic's values of this rank's slice."""
        self.critic.model.eval()
        return self.settings.critic.batching.score(
            batch, self.device, lambda micro: response_values(self.critic.model, micro)
        )

    def update_policy(self, batch: TensorDict, correction: RolloutCorrection = RolloutCorrection()) -> dict[str, float]:
        """PPO updates of the policy on this rank's slice (see ``Trainable.update``); metrics as verl names them.

        ``batch`` carries ``old_log_probs`` (the rollout's in bypass mode), ``advantages`` and ``response_mask``,
        plus ``rollout_is_weights`` from decoupled rollout correction and ``ref_log_probs`` when ``actor.use_kl_loss``.
        ``correction``: the run's rollout correction as the trainer resolved it (its bypass mode corrects here).
        """
        return self._update_policy(batch, correction)[0]

    def update_policy_scoring_old(
        self, batch: TensorDict, correction: RolloutCorrection
    ) -> tuple[dict[str, float], torch.Tensor]:
        """``update_policy`` on a batch without ``old_log_probs``, for an update that is one optimizer step (one
        epoch, one mini-batch): the parameters do not move before that step, so each micro-batch's own forward
        pass gives its old log-probs (detached), and the re-scoring pass of ``compute_log_prob`` is saved.
        ``correction``'s importance weights (token or sequence level, row by row) come from them, micro-batch by
        micro-batch. Returns the metrics and the old log-probs, in the batch's order. A policy whose training
        forward pass differs from its scoring one (dropout) is re-scored first instead."""
        if self.policy_has_dropout:
            batch["old_log_probs"] = self.compute_log_prob(batch)
            correct_batch(batch, correction)
            return self._update_policy(batch, correction)[0], batch["old_log_probs"]
        return self._update_policy(batch, correction, scoring_old=True)

    def _update_policy(
        self, batch: TensorDict, correction: RolloutCorrection, scoring_old: bool = False
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        actor = self.actor
        scale, mode = actor.loss_scale_factor, actor.update.loss_agg_mode
        old_log_probs = None
        if scoring_old:
            old_log_probs = torch.zeros(batch["responses"].shape, dtype=torch.float32)
            batch["row_index"] = torch.arange(len(batch))

        def loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, Any]]:
            log_probs, entropy = response_log_probs(self.policy.model, micro, self.temperature)
            if scoring_old:
                old = micro["old_log_probs"] = log_probs.detach()
                if not is_stand_in(micro):  # (a stand-in's row is scored in its own micro-batch)
                    old_log_probs[micro["row_index"].cpu()] = old.cpu()
                weights = correct(old, micro["rollout_log_probs"], micro["response_mask"].float(), correction)[0]
                if weights is not None:
                    micro["rollout_is_weights"] = weights
            pg_loss, mask, stats = policy_gradient_loss(micro, log_probs, actor, correction)
            entropy_bonus = algorithms.aggregate_loss(entropy, mask, mode, scale)
            total = pg_loss - actor.entropy_coeff * entropy_bonus
            if actor.use_kl_loss:
                kl = algorithms.kl_penalty(log_probs, micro["ref_log_probs"], actor.kl_loss_type)
                stats["actor/kl_loss"] = algorithms.aggregate_loss(kl, mask, mode, scale)
                stats["actor/kl_coef"] = actor.kl_loss_coef
                total = total + actor.kl_loss_coef * stats["actor/kl_loss"]
            return total, {"actor/pg_loss": pg_loss, "actor/entropy": entropy_bonus, **stats}

        return self.policy.update(batch, actor.update, self._mini_batch_size(actor.update, batch), loss), old_log_probs

    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        """Clipped value-loss updates of the critic against ``returns`` (``values`` are the old values)."""
        settings = self.settings.critic

        def loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, Any]]:
            mask = micro["response_mask"].float()
            values = response_values(self.critic.model, micro)
            value_loss, stats = algorithms.value_loss(
                values, micro["values"], micro["returns"], mask, settings.cliprange_value, settings.update.loss_agg_mode
            )
            return value_loss, {
                "critic/vf_loss": value_loss,
                "critic/vf_clipfrac": stats["vf_clipfrac"],
                "critic/vpred_mean": algorithms.masked_mean(values, mask),
            }

        return self.critic.update(batch, settings.update, self._mini_batch_size(settings.update, batch), loss)

    def _mini_batch_size(self, update: UpdateSettings, batch: TensorDict) -> int:
        """Trajectories per mini-batch on this rank: ``ppo_mini_batch_size`` counts prompts over all ranks (verl's
        convention), each with ``rollout.n`` trajectories; null: the whole slice."""
        if not update.ppo_mini_batch_size:
            return len(trajectory_sizes(batch))
        return update.ppo_mini_batch_size * self.settings.samples_per_prompt // self.world_size

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every policy parameter, unsharded, on CPU — on rank 0 (other ranks return an empty dict).

        A collective: call it on every rank at once.
        """
        return get_model_state_dict(self.policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def packed_state_dict(
        self, dtype: torch.dtype | None = None
    ) -> PackedWeights | PackedAdapter | dict[str, PackedAdapter] | None:
        """``full_state_dict`` ready for the push: rank 0's weights as raw bytes that Ray stores without
        pickling them (None on the other ranks); with LoRA, the adapter only (several: each, by name). A collective,
        like ``full_state_dict``.

        ``dtype``: the servers' (``rollout.dtype``), each tensor cast to it as it is gathered: what a server would
        load anyway, and in bf16 half the bytes to gather, store and read, the float32 model never whole on rank 0."""
        if self.lora is not None:
            adapter = lora.gather_adapter(self.policy.model)
            if self.rank != 0:
                return None
            if self.lora.several:
                return lora.pack_adapters(self.policy.model, adapter)
            return lora.pack_adapter(self.policy.model, adapter)
        state = self._served_state_dict(dtype)
        return PackedWeights.pack(state) if state else None

    def _served_state_dict(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """``full_state_dict`` as the servers load it: cast to their ``dtype`` (``rollout.dtype``) as gathered."""
        return self.full_state_dict() if dtype in (None, torch.float32) else self._gathered_as(dtype)

    def _gathered_as(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``full_state_dict`` cast to ``dtype`` tensor by tensor (a tied weight gathered once)."""
        state: dict[str, torch.Tensor] = {}
        gathered: dict[int, torch.Tensor | None] = {}  # by the sharded tensor's id: tied weights share it
        for name, shard in get_model_state_dict(self.policy.model).items():
            if id(shard) not in gathered:
                whole = shard.full_tensor() if isinstance(shard, DTensor) else shard
                cast = dtype if whole.is_floating_point() else whole.dtype
                gathered[id(shard)] = whole.to("cpu", cast) if self.rank == 0 else None  # (the others keep none)
            if self.rank == 0:
                state[name] = gathered[id(shard)]
        release_freed_memory()  # the float32 layers gathered one by one (see agentloop.allocator)
        return state

    def keep_for_push(self, dtype: torch.dtype | None = None) -> None:
        """Gather the policy (cast to the servers' ``dtype``, as ``packed_state_dict``) and keep it on rank 0 for
        ``broadcast_weights`` (``rollout.weight_sync=collective``). A collective, like ``full_state_dict``."""
        self.keep_weights(self._served_state_dict(dtype))

    def save_for_push(self, directory: str, version: int | None, dtype: torch.dtype | None = None) -> str | None:
        """Write the policy (cast to the servers' ``dtype``, as ``packed_state_dict``) as a Hugging Face checkpoint in
        a new folder under ``directory`` (rank 0; the previous push's folder removed) for ``rollout.weight_sync=disk``;
        returns it (None on the other ranks). A collective."""
        state = self._served_state_dict(dtype)
        if self.rank != 0:
            return None
        previous = getattr(self, "_pushed_directory", None)
        if previous is None:
            remove_orphaned_pushes(directory)
        target = tempfile.mkdtemp(f"-v{version}", f"{PUSH_PREFIX}{socket.gethostname()}-{os.getpid()}-", directory)
        self.policy.model.save_pretrained(target, state_dict=state)
        del state
        release_freed_memory()  # the gathered policy and its serialized copy (see agentloop.allocator)
        if previous:
            shutil.rmtree(previous, ignore_errors=True)
        self._pushed_directory = target
        return target

    def save_checkpoint(self, directory: str, hf_directory: str | None = None) -> None:
        """Save model, optimizer and LR schedule of the policy (and critic) as a sharded ``torch.distributed.checkpoint``.

        A collective. With ``hf_directory``, rank 0 also writes the policy as a Hugging Face checkpoint (with
        LoRA: the adapter in PEFT's format in ``lora_adapter`` beside it, as verl does; several: ``lora_adapter/<name>``).
        """
        dcp.save(self._trainables_state(), checkpoint_id=directory)
        if hf_directory and self.lora is not None:
            adapter = lora.gather_adapter(self.policy.model)
            if self.rank == 0:
                lora.save_adapter(self.policy.model, adapter, Path(hf_directory))
        elif hf_directory:
            state = self.full_state_dict()
            if self.rank == 0:
                self.policy.model.save_pretrained(hf_directory, state_dict=state)
        dist.barrier()

    def load_checkpoint(self, directory: str) -> None:
        """Restore what ``save_checkpoint`` wrote (a collective)."""
        state = self._trainables_state()
        dcp.load(state, checkpoint_id=directory)
        self.policy.load(state["policy"])
        if self.critic is not None:
            self.critic.load(state["critic"])

    def _trainables_state(self) -> dict[str, Any]:
        state = {"policy": self.policy.state()}
        if self.critic is not None:
            state["critic"] = self.critic.state()
        return state

    def shutdown(self) -> None:
        """Leave the process group; remove the last disk push (``weight_sync_dir`` is a RAM disk by default: a
        folder left there holds a copy of the model in memory until the machine restarts)."""
        pushed = getattr(self, "_pushed_directory", None)
        if pushed:
            shutil.rmtree(pushed, ignore_errors=True)
        dist.destroy_process_group()


PUSH_PREFIX = "agentloop-push-"


def remove_orphaned_pushes(directory: str) -> list[str]:
    """Remove the disk pushes under ``directory`` that a process of this host no longer running left behind (a
    killed rank cannot clean up, and ``weight_sync_dir`` is a RAM disk by default); returns them. A folder of
    another host (a shared ``weight_sync_dir``) is that host's to judge."""
    host, removed = socket.gethostname(), []
    for folder in Path(directory).glob(f"{PUSH_PREFIX}{host}-*-*"):
        pid = folder.name.removeprefix(f"{PUSH_PREFIX}{host}-").split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def launch_workers(
    settings: RankSettings, world_size: int, total_steps: int, worker_class: Any = FSDPWorker
) -> tuple[list[ray.actor.ActorHandle], list[ray.ObjectRef]]:
    """Start ``world_size`` ranks without waiting for them: returns the actors and their ``init_group`` calls, which
    form the process group at rank 0's address and load the models while the caller starts everything else."""
    # One GPU per rank; on CPU the ranks claim no logical CPU (unless trainer.resources_per_rank says), so they
    # never wait behind the servers.
    options = {
        **actor_resources(settings.resources, "trainer.resources_per_rank"),
        "num_gpus": rank_gpus(settings.device, world_size),
    }
    workers = [
        worker_class.options(**options).remote(settings, rank, world_size, total_steps) for rank in range(world_size)
    ]
    rendezvous = workers[0].rendezvous_address.remote()  # Ray hands its value to each init_group once it is ready
    return workers, [worker.init_group.remote(rendezvous) for worker in workers]


def join_workers(
    workers: list[ray.actor.ActorHandle], loading: list[ray.ObjectRef], timeout_s: float
) -> list[ray.actor.ActorHandle]:
    """Wait for launched ranks to form their group and load their models; on any failure none is left running."""
    try:
        wait_for(
            loading,
            timeout_s,
            f"{len(workers)} FSDP ranks to start, form a group and load their models (cluster resources: {ray.cluster_resources()})",
        )
    except BaseException:
        for worker in workers:
            ray.kill(worker)
        raise
    return workers


def start_workers(
    settings: RankSettings, world_size: int, total_steps: int, timeout_s: float, worker_class: Any = FSDPWorker
) -> list[ray.actor.ActorHandle]:
    """Start ``world_size`` ranks, form their process group at rank 0's address, and wait for the models."""
    return join_workers(*launch_workers(settings, world_size, total_steps, worker_class), timeout_s)


def rank_gpus(device: str, world_size: int) -> int:
    """GPUs per FSDP rank (0 or 1) for ``trainer.device`` (auto, cuda or cpu): auto takes GPUs when the Ray cluster
    has any."""
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    if device == "cpu" or (device == "auto" and cluster_gpus == 0):
        return 0
    if cluster_gpus < world_size:
        raise ValueError(
            f"trainer.device={device}: {world_size} FSDP ranks (trainer.n_gpus_per_node x trainer.nnodes) need one GPU each, "
            f"and the Ray cluster has {cluster_gpus}; lower n_gpus_per_node, add GPUs, or set trainer.device=cpu"
        )
    return 1


def push_weights(
    workers: list[ray.actor.ActorHandle],
    manager: AgentLoopManager,
    timeout_s: float,
    version: int | None = None,
    path: str | None = None,
) -> None:
    """Gather the policy on rank 0 and load it into every rollout server as policy ``version``.

    By ``rollout.weight_sync``: ``object_store``, the servers read rank 0's packed weights straight from Ray's object
    store (the bytes never pass through the driver, and are never pickled); ``collective``, rank 0 keeps them and
    broadcasts them to the servers; ``disk``, rank 0 writes a checkpoint under ``weight_sync_dir`` that they load.
    ``path`` overrides the setting (the benchmark compares them on one set of servers).
    """
    sync = manager.settings.servers.weight_sync
    path = path or sync.path
    served = getattr(torch, manager.settings.servers.dtype, None)  # (an engine's "auto" casts nothing here)
    dtype = served if isinstance(served, torch.dtype) else None
    if path == "collective":  # rank 0 keeps the gathered weights and broadcasts them to the servers
        wait_for(
            [worker.keep_for_push.remote(dtype) for worker in workers], timeout_s, "the weight gather on the FSDP ranks"
        )
        manager.update_weights_collective(workers[0], version)
        return
    if path == "disk":
        saved = [worker.save_for_push.remote(sync.dir, version, dtype) for worker in workers]
        manager.update_weights_from_disk(wait_for(saved, timeout_s, "the weights written for the push")[0], version)
        return
    refs = [worker.packed_state_dict.remote(dtype) for worker in workers]
    # every rank first (a failed rank surfaces as itself), without fetching rank 0's weights here
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    if pending:
        raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for the weight gather on the FSDP ranks")
    ray.get(refs[1:])
    manager.update_weights(refs[0], version)
