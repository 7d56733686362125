"""The FSDP ranks' settings: the policy (``actor_rollout_ref.model``, ``.actor``), the frozen reference
(``actor_rollout_ref.ref``) and the critic (``critic``), read once from their sections and checked there (a bad value
fails naming its key and the fix); ``trainer.settings.rank_settings`` builds them from the composed config.

A model (``ModelSettings``) is kept apart from how it is trained (``ActorSettings``, ``CriticSettings``), as verl keeps
``actor_rollout_ref.model`` apart from ``.actor``: settings of the model itself (an adapter's, say) join it there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentloop.settings.reading import Section
from trainer import algorithms
from trainer.lora import LoraSettings
from trainer.micro_batches import MicroBatching

WARMUP_STYLES = ("constant", "cosine")
DEVICES = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class ModelSettings:
    """A model the ranks load: its checkpoint, whether its activations are recomputed in the backward pass, and the
    LoRA adapter it trains (``lora_*``, the policy's only; None: full-weight training, ``trainer.lora``)."""

    path: str
    enable_gradient_checkpointing: bool = False
    lora: LoraSettings | None = None

    @classmethod
    def from_section(cls, model: Section, lora: bool = False) -> ModelSettings:
        """``model`` (``actor_rollout_ref.model`` or ``critic.model``); with ``lora``, its LoRA keys too."""
        adapter = LoraSettings.from_section(model) if lora else None
        return cls(
            model.str("path"),
            model.bool("enable_gradient_checkpointing", default=False),
            adapter if adapter is not None and adapter.enabled else None,
        )


@dataclass(frozen=True)
class FSDPSettings:
    """``fsdp_config``: the parameters in CPU memory (``param_offload`` or ``offload_policy``: FSDP2's
    ``CPUOffloadPolicy``), or only the optimizer state between updates (``optimizer_offload``); and verl's
    ``mixed_precision`` (FSDP2's ``MixedPrecisionPolicy``): the forward and backward passes run on parameters
    gathered in ``param_dtype`` (torch's name; None: float32 throughout) and gradients are reduced in
    ``reduce_dtype``, while the sharded parameters and the optimizer state stay float32."""

    param_offload: bool = False
    optimizer_offload: bool = False
    param_dtype: str | None = None
    reduce_dtype: str = "float32"

    @classmethod
    def from_section(cls, fsdp: Section) -> FSDPSettings:
        """A null or absent flag is off (the reference's ``optimizer_offload`` is a verl key that means nothing)."""

        def flag(name: str) -> bool:
            return fsdp.raw(name) is not None and fsdp.bool(name)

        offload = (flag("param_offload") or flag("offload_policy"), flag("optimizer_offload"))
        if fsdp.raw("mixed_precision") is None:
            return cls(*offload)
        fsdp.mapping("mixed_precision")  # ({}: verl's defaults, bf16 parameters and fp32 reductions)
        precision = fsdp.sub("mixed_precision")
        # FSDP2 casts no buffers (verl's buffer_dtype): they stay as loaded, float32
        if _precision(precision, "buffer_dtype", "fp32") != "float32":
            raise precision.error("buffer_dtype", "is not supported: FSDP2 keeps buffers in float32", "remove it")
        return cls(
            *offload, _precision(precision, "param_dtype", "bf16"), _precision(precision, "reduce_dtype", "fp32")
        )


# verl's precision names (verl.utils.torch_dtypes.PrecisionType) and torch's, as torch names them
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16"}
PRECISIONS |= {"float16": "float16", "float32": "float32", "16": "float16", "32": "float32"}


def _precision(section: Section, name: str, default: str) -> str:
    """A dtype of ``mixed_precision`` (verl's spelling or torch's), as torch names it."""
    value = str(section.raw(name, default))
    if value not in PRECISIONS:
        raise section.error(name, "is not a floating-point precision", "use bf16, fp16 or fp32")
    return PRECISIONS[value]


@dataclass(frozen=True)
class OptimSettings:
    """``optim``: AdamW and its LR schedule (constant or cosine, after a warm-up)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_style: str = "constant"
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0

    @classmethod
    def from_section(cls, optim: Section) -> OptimSettings:
        return cls(
            optim.float("lr", minimum=0.0),
            optim.float("weight_decay", minimum=0.0),
            optim.str("warmup_style", WARMUP_STYLES, default="constant"),
            optim.int("lr_warmup_steps", default=-1),
            optim.float("lr_warmup_steps_ratio", minimum=0.0, default=0.0),
            optim.float("min_lr_ratio", minimum=0.0, default=0.0),
        )

    def warmup_steps(self, total_steps: int) -> int:
        """``lr_warmup_steps``; where it is negative, ``lr_warmup_steps_ratio`` of ``total_steps``."""
        return self.lr_warmup_steps if self.lr_warmup_steps >= 0 else int(self.lr_warmup_steps_ratio * total_steps)


def _batching(
    section: Section, size: str, dynamic: str, max_tokens: str, fallback: Section | None = None
) -> MicroBatching:
    """Micro-batches of ``size`` rows, or with ``dynamic`` of about ``max_tokens`` tokens; a null ``size`` is
    ``fallback``'s ``ppo_micro_batch_size_per_gpu``."""
    rows = section.optional_int(size, minimum=1)
    if rows is None and fallback is not None:
        rows = fallback.int("ppo_micro_batch_size_per_gpu", minimum=1)
    if rows is None:
        raise section.error(size, "is empty", "set it to the rows per micro-batch")
    tokens = section.int(max_tokens, default=0)
    if tokens <= 0:
        raise section.error(
            max_tokens, "must be positive (tokens per micro-batch with use_dynamic_bsz)", "set it above 0"
        )
    return MicroBatching(rows, section.bool(dynamic, default=False), tokens)


@dataclass(frozen=True)
class UpdateSettings:
    """A PPO update of the actor or critic: ``ppo_epochs`` passes in mini-batches of ``ppo_mini_batch_size`` prompts
    over all ranks (None: each rank's whole slice), gradients accumulated over ``micro_batching``'s micro-batches,
    clipped to ``grad_clip``, the loss aggregated by ``loss_agg_mode``."""

    ppo_epochs: int = 1
    ppo_mini_batch_size: int | None = None
    micro_batching: MicroBatching = MicroBatching(4)
    grad_clip: float = 1.0
    loss_agg_mode: str = "token-mean"

    @classmethod
    def from_section(cls, section: Section) -> UpdateSettings:
        """From an actor or critic section (``ppo_*``, ``use_dynamic_bsz``, ``grad_clip``, ``loss_agg_mode``)."""
        return cls(
            section.int("ppo_epochs", minimum=1),
            section.optional_int("ppo_mini_batch_size", minimum=0) or None,  # 0 means null too, as in verl
            _batching(section, "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
            section.float("grad_clip", positive=True),
            section.str("loss_agg_mode", algorithms.LOSS_AGG_MODES),
        )


def _optional_above(section: Section, name: str, bound: float, fix: str) -> float | None:
    """A number above ``bound``, or null."""
    if section.raw(name) is None:
        return None
    value = section.float(name)
    if not value > bound:
        raise section.error(name, f"must be > {bound:g}", fix)
    return value


@dataclass(frozen=True)
class ActorSettings:
    """``actor_rollout_ref.actor``: the policy's optimizer, update, sharding and loss (PPO's clip range, dual clip
    ``clip_ratio_c``, entropy bonus, KL loss to the reference)."""

    optim: OptimSettings = OptimSettings()
    update: UpdateSettings = UpdateSettings()
    fsdp: FSDPSettings = FSDPSettings()
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"

    @classmethod
    def from_section(cls, actor: Section) -> ActorSettings:
        return cls(
            optim=OptimSettings.from_section(actor.sub("optim")),
            update=UpdateSettings.from_section(actor),
            fsdp=FSDPSettings.from_section(actor.sub("fsdp_config")),
            clip_ratio_low=actor.float("clip_ratio_low", minimum=0.0),
            clip_ratio_high=actor.float("clip_ratio_high", minimum=0.0),
            clip_ratio_c=_optional_above(
                actor, "clip_ratio_c", 1, "set it above 1 (dual-clip PPO), or null for no dual clip"
            ),
            loss_scale_factor=_optional_above(
                actor, "loss_scale_factor", 0, "set it above 0, or null for the response length"
            ),
            entropy_coeff=actor.float("entropy_coeff"),
            use_kl_loss=actor.bool("use_kl_loss"),
            kl_loss_coef=actor.float("kl_loss_coef"),
            kl_loss_type=actor.str("kl_loss_type", algorithms.KL_ESTIMATORS),
        )


@dataclass(frozen=True)
class ReferenceSettings:
    """``actor_rollout_ref.ref``: the frozen reference policy (KL) and its scoring micro-batches."""

    model: ModelSettings
    fsdp: FSDPSettings = FSDPSettings()
    batching: MicroBatching = MicroBatching(4)

    @classmethod
    def from_section(cls, ref: Section, actor: Section) -> ReferenceSettings:
        """``actor``: the actor's section, whose micro-batch size a null ``log_prob_micro_batch_size_per_gpu`` takes."""
        return cls(
            ModelSettings(ref.sub("model").str("path")),
            FSDPSettings.from_section(ref.sub("fsdp_config")),
            log_prob_batching(ref, actor),
        )


def log_prob_batching(section: Section, actor: Section) -> MicroBatching:
    """A log-prob pass's micro-batches: ``rollout.log_prob_*`` (old log-probs) or ``ref.log_prob_*``; without a
    size of their own, the actor's."""
    return _batching(
        section,
        "log_prob_micro_batch_size_per_gpu",
        "log_prob_use_dynamic_bsz",
        "log_prob_max_token_len_per_gpu",
        fallback=actor,
    )


@dataclass(frozen=True)
class CriticSettings:
    """``critic``: the value model (GAE), its optimizer, update and value clip, and its scoring micro-batches."""

    model: ModelSettings
    fsdp: FSDPSettings = FSDPSettings()
    optim: OptimSettings = OptimSettings()
    update: UpdateSettings = UpdateSettings()
    cliprange_value: float = 0.5
    batching: MicroBatching = MicroBatching(4)

    @classmethod
    def from_section(cls, critic: Section) -> CriticSettings:
        return cls(
            ModelSettings.from_section(critic.sub("model")),
            FSDPSettings.from_section(critic.sub("model").sub("fsdp_config")),
            OptimSettings.from_section(critic.sub("optim")),
            UpdateSettings.from_section(critic),
            critic.float("cliprange_value", minimum=0.0),
            _batching(critic, "forward_micro_batch_size_per_gpu", "use_dynamic_bsz", "forward_max_token_len_per_gpu"),
        )


@dataclass(frozen=True)
class RankSettings:
    """What an FSDP rank needs: the policy (``model``, ``actor``), how its old log-probs are scored (``rollout.n``
    samples per prompt at ``rollout.temperature``, in ``log_prob_batching``'s micro-batches), the reference and the
    critic when the run has them (else None), and from ``trainer.*``: the collectives' bound (``step_timeout_s``), the
    ranks sharing a node's cores (``n_gpus_per_node``), the ``device`` and the Ray resources each rank asks for
    besides its GPU (``resources_per_rank``)."""

    model: ModelSettings
    actor: ActorSettings = ActorSettings()
    samples_per_prompt: int = 1
    temperature: float = 1.0
    log_prob_batching: MicroBatching = MicroBatching(4)
    ref: ReferenceSettings | None = None
    critic: CriticSettings | None = None
    step_timeout_s: float = 1800.0
    ranks_per_node: int = 1
    device: str = "auto"
    resources: dict[str, float] = field(default_factory=dict)
