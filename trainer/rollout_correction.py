"""Rollout correction: the rollout engine samples from π_rollout, the trainer scores with π_train.

verl's ``algorithm.rollout_correction``: truncated importance weights π_train / π_rollout per token or
per sequence (optionally rescaled to mean 1 over the batch), rejection of tokens or sequences whose
divergence estimate leaves given bounds, and the diagnostics ``rollout_corr/*``. Two operating modes:

- decoupled (``bypass_mode=false``): the trainer re-scores the batch (old log-probs), and this module runs
  once on the whole batch before the advantages; the PPO loss multiplies by the weights;
- bypass (``bypass_mode=true``): the rollout's log-probs serve as old log-probs (no re-scoring pass), and
  this module runs on each micro-batch against the current policy; ``loss_type`` picks PPO's ratio
  (``ppo_clip``, the weights only reported) or REINFORCE with the weights (``reinforce``).

Shapes as in ``trainer.algorithms``: ``[B, R]``, ``mask`` 1 on model tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
from tensordict import TensorDict

from agentloop.settings.reading import Section
from trainer.algorithms import masked_mean
from trainer.rank_settings import UpdateSettings

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
LOSS_TYPES = ("ppo_clip", "reinforce")
SECTION = "algorithm.rollout_correction"
# exp(±20) bounds every weight, so that one far-off token cannot overflow a sequence's product
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """The resolved ``algorithm.rollout_correction`` settings (see ``from_sections`` for the older keys)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    # per rollout_rs option: (lower, upper) bounds on its statistic; k1 bounds are logs of bounds on π_rollout / π_train
    rejection_bounds: dict[str, tuple[float | None, float]] = field(default_factory=dict, compare=False)

    @classmethod
    def from_sections(cls, algorithm: Section, actor: Section) -> RolloutCorrection:
        """Read and check ``algorithm.rollout_correction`` (``algorithm``: the ``algorithm`` section); raise
        ``ValueError`` naming the key at fault. In ``actor`` (``actor_rollout_ref.actor``),
        ``rollout_is_threshold`` (agentloop's earlier knob) and ``tis_imp_ratio_cap`` (verl's earlier one, > 0 on)
        both mean ``rollout_is=token`` with that threshold."""
        section = algorithm.mapping("rollout_correction")
        legacy = _legacy_token_threshold(actor)
        if legacy is not None:
            if section.get("rollout_is") is not None:
                raise ValueError(
                    f"{legacy[0]} and {SECTION}.rollout_is both ask for importance sampling: "
                    f"keep {SECTION}.rollout_is and {SECTION}.rollout_is_threshold, and drop {legacy[0]}"
                )
            section.update(rollout_is="token", rollout_is_threshold=legacy[1])
        known = [f.name for f in fields(cls) if f.compare]
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(f"{SECTION}.{unknown[0]} is not a rollout-correction key here; the keys are {known}")
        settings = cls(**section)
        settings._check()
        return replace(settings, rejection_bounds=settings._parse_rejection_bounds())

    @property
    def uses_rollout_log_probs(self) -> bool:
        """Whether the loss depends on the rollout's log-probs (importance weights, rejection, bypass)."""
        return self.bypass_mode or self.rollout_is is not None or self.rollout_rs is not None

    def _check(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"{SECTION}.rollout_is={self.rollout_is!r}; choose null, token or sequence")
        if self.rollout_is is not None and not float(self.rollout_is_threshold) > 0:
            raise ValueError(f"{SECTION}.rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"{SECTION}.loss_type={self.loss_type!r}; choose one of {LOSS_TYPES}")
        if self.loss_type != "ppo_clip" and not self.bypass_mode:
            raise ValueError(
                f"{SECTION}.loss_type={self.loss_type} only applies with {SECTION}.bypass_mode=true "
                "(decoupled mode always uses the PPO loss): set bypass_mode=true or loss_type=ppo_clip"
            )

    def _parse_rejection_bounds(self) -> dict[str, tuple[float | None, float]]:
        if self.rollout_rs is None:
            return {}
        options = list(dict.fromkeys(part.strip() for part in str(self.rollout_rs).split(",") if part.strip()))
        unknown = [option for option in options if option not in RS_OPTIONS]
        if not options or unknown:
            raise ValueError(f"{SECTION}.rollout_rs={self.rollout_rs!r}; comma-separated options from {RS_OPTIONS}")
        if self.rollout_rs_threshold is None:
            raise ValueError(
                f"{SECTION}.rollout_rs needs {SECTION}.rollout_rs_threshold (one bound, or one per option)"
            )
        specs = [part.strip() for part in str(self.rollout_rs_threshold).split(",") if part.strip()]
        if len(specs) not in (1, len(options)):
            raise ValueError(
                f"{SECTION}.rollout_rs_threshold={self.rollout_rs_threshold!r}: give one bound for all "
                f"{len(options)} rollout_rs options, or one per option"
            )
        specs = specs * len(options) if len(specs) == 1 else specs
        return {option: _rejection_bound(option, spec) for option, spec in zip(options, specs)}


def _legacy_token_threshold(actor: Section) -> tuple[str, float] | None:
    """The older token-level TIS keys that are on, as (key, threshold); they must agree when both are."""
    found = {}
    if actor.raw("rollout_is_threshold") is not None:
        found[f"{actor.key}.rollout_is_threshold"] = actor.float("rollout_is_threshold")
    if actor.raw("tis_imp_ratio_cap") is not None and actor.float("tis_imp_ratio_cap") > 0:
        found[f"{actor.key}.tis_imp_ratio_cap"] = actor.float("tis_imp_ratio_cap")
    if len(set(found.values())) > 1:
        raise ValueError(f"{' and '.join(found)} both set token-level truncation, to different values: keep one")
    return next(iter(found.items()), None)


def _rejection_bound(option: str, spec: str) -> tuple[float | None, float]:
    """``spec`` for one option: k1 options take ratio bounds ``lower_upper`` or ``upper`` (lower = 1/upper),
    compared in log space; k2/k3 options take one upper bound."""
    where = f"{SECTION}.rollout_rs_threshold for {option}"
    try:
        parts = [float(part) for part in spec.split("_")]
    except ValueError:
        raise ValueError(f"{where}: {spec!r} is not a number (k1 options also take 'lower_upper')") from None
    if any(part <= 0 for part in parts) or len(parts) > (2 if option.endswith("k1") else 1):
        raise ValueError(f"{where}: {spec!r}; k1 options take 'upper' or 'lower_upper', others one bound, all > 0")
    if not option.endswith("k1"):
        return None, parts[0]
    lower, upper = parts if len(parts) == 2 else (1 / parts[0], parts[0])
    return math.log(lower), math.log(upper)


def correct(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, settings: RolloutCorrection
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Importance weights (None when ``rollout_is`` is off), the mask narrowed by rejection sampling, and the
    ``rollout_corr/*`` metrics, from π_train's and π_rollout's log-probs of the sampled tokens."""
    with torch.no_grad():
        log_ratio = train_log_prob - rollout_log_prob
        metrics = offpolicy_metrics(train_log_prob, rollout_log_prob, mask)
        weights = None
        if settings.rollout_is is not None:
            weights, is_metrics = importance_weights(
                log_ratio,
                mask,
                settings.rollout_is,
                float(settings.rollout_is_threshold),
                bool(settings.rollout_is_batch_normalize),
            )
            metrics.update(is_metrics)
        if settings.rejection_bounds:
            mask, rs_metrics = rejection_mask(log_ratio, mask, settings.rejection_bounds)
            metrics.update(rs_metrics)
    return weights, mask, {f"rollout_corr/{key}": float(value) for key, value in metrics.items()}


def old_log_probs_in_update(
    update: UpdateSettings, samples_per_prompt: int, kl_in_reward: bool, settings: RolloutCorrection, batch_size: int
) -> bool:
    """Whether the policy update can take the old log-probs from its own forward passes, saving the re-scoring
    pass (``FSDPWorker.update_policy_scoring_old``): the update is one optimizer step (``ppo_epochs`` 1, one
    mini-batch), so the parameters have not moved when each micro-batch is scored; decoupled mode with weights
    taken row by row (no rejection sampling, no batch normalisation); and no KL penalty in the reward, which
    needs the old log-probs before the advantages (``kl_in_reward``). ``update``: the actor's; ``samples_per_prompt``:
    ``rollout.n``."""
    samples_per_mini_batch = (update.ppo_mini_batch_size or 0) * samples_per_prompt
    one_step = update.ppo_epochs == 1 and (not samples_per_mini_batch or samples_per_mini_batch >= batch_size)
    row_by_row = not (settings.bypass_mode or settings.rejection_bounds or settings.rollout_is_batch_normalize)
    return one_step and row_by_row and not kl_in_reward


def correct_batch(batch: TensorDict, settings: RolloutCorrection) -> dict[str, float]:
    """Decoupled mode on the whole batch (``old_log_probs`` against ``rollout_log_probs``), before the
    advantages: adds ``rollout_is_weights`` when ``rollout_is`` is on, narrows ``response_mask`` by
    rejection sampling, and returns the metrics."""
    mask = batch["response_mask"]
    weights, kept, metrics = correct(batch["old_log_probs"], batch["rollout_log_probs"], mask.float(), settings)
    if weights is not None:
        batch["rollout_is_weights"] = weights
    batch["response_mask"] = kept.to(mask.dtype)
    return metrics


def importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float, batch_normalize: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights min(π_train / π_rollout, threshold), 0 off the mask.

    ``token``: one ratio per token; ``sequence``: the product of the row's token ratios on every token of the
    row. ``batch_normalize`` then divides by their mean (over tokens, or over rows for ``sequence``).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}; choose one of {IS_LEVELS}")
    if level == "token":
        raw = _bounded_exp(log_ratio) * mask
        present = raw[mask.bool()]
    else:
        row_weights = _bounded_exp((log_ratio * mask).sum(dim=-1, keepdim=True))
        raw = row_weights * mask
        present = row_weights[mask.sum(dim=-1) > 0].flatten()
    metrics = _weight_metrics(present, threshold)
    weights = raw.clamp(max=threshold)
    if batch_normalize and present.numel():
        mean = present.clamp(max=threshold).mean()
        factor = mean if mean > 1e-8 else torch.ones_like(mean)
        weights, metrics["rollout_is_batch_norm_factor"] = weights / factor, factor
    return weights.detach(), metrics


def _bounded_exp(log_values: torch.Tensor) -> torch.Tensor:
    return log_values.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def _weight_metrics(weights: torch.Tensor, threshold: float) -> dict[str, torch.Tensor]:
    """verl's ``rollout_is_*`` statistics of the untruncated weights (one per token, or one per row)."""
    if not weights.numel():
        return {}
    # the effective sample size is taken over weights bounded to [1/threshold, threshold], as verl does
    bounded = weights.clamp(1 / threshold, threshold)
    return {
        "rollout_is_mean": weights.mean(),
        "rollout_is_max": weights.max(),
        "rollout_is_min": weights.min(),
        "rollout_is_ratio_fraction_high": (weights > threshold).float().mean(),
        "rollout_is_ratio_fraction_low": (weights < 1 / threshold).float().mean(),
        "rollout_is_eff_sample_size": 1 / (bounded / bounded.mean()).square().mean(),
    }


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, bounds: dict[str, tuple[float | None, float]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``mask`` with the tokens (``token_*``) or whole rows (``seq_*``) that fail any option's bounds zeroed.

    Per-token statistics of log r = log π_train - log π_rollout: k1 = -log r (kept within [lower, upper], the
    logs of bounds on π_rollout / π_train),
    k2 = (log r)^2 / 2, k3 = r - 1 - log r (kept at most upper); ``seq_sum`` / ``seq_mean`` / ``seq_max``
    reduce them over the row's model tokens.
    """
    safe = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1 - safe}
    keep = torch.ones_like(mask, dtype=torch.bool)
    metrics = {}
    for option, (lower, upper) in bounds.items():
        statistic = _rejection_statistic(option, per_token[option[-2:]], mask)
        passes = statistic <= upper if lower is None else (statistic >= lower) & (statistic <= upper)
        passes = passes.expand_as(mask)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean((~passes).float(), mask)
        keep &= passes
    rows_hit = ((~keep) & mask.bool()).any(dim=-1)
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep).float(), mask)
    metrics["rollout_rs_seq_masked_fraction"] = rows_hit.float().mean()
    return mask * keep.to(mask.dtype), metrics


def _rejection_statistic(option: str, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The option's statistic: per token ``[B, R]``, or per row ``[B, 1]``."""
    if option.startswith("token_"):
        return per_token
    if option.startswith("seq_sum_"):
        return (per_token * mask).sum(dim=-1, keepdim=True)
    if option.startswith("seq_mean_"):
        return masked_mean(per_token, mask, dim=-1).unsqueeze(-1)
    row_max = per_token.masked_fill(mask == 0, float("-inf")).max(dim=-1, keepdim=True).values
    return torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)


def offpolicy_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far π_rollout is from π_train on the sampled tokens (verl's names, plus ``abs_log_prob_diff``).

    ``kl``: mean log π_rollout - log π_train (k1 of KL(π_rollout || π_train)); ``k3_kl``: mean r - 1 - log r;
    ``chi2_token`` / ``chi2_seq``: E[r^2] - 1 per token / per row's product; ``training_ppl``, ``rollout_ppl``
    and ``log_ppl_diff`` over rows with model tokens.
    """
    log_ratio = train_log_prob - rollout_log_prob
    safe = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rows = (mask.sum(dim=-1) > 0).to(mask.dtype)
    train_row = masked_mean(train_log_prob, mask, dim=-1)
    rollout_row = masked_mean(rollout_log_prob, mask, dim=-1)
    row_log_ratio = (log_ratio * mask).sum(dim=-1)
    return {
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(safe.exp() - 1 - safe, mask),
        "abs_log_prob_diff": masked_mean(log_ratio.abs(), mask),
        "chi2_token": masked_mean(_bounded_exp(2 * safe), mask) - 1,
        "chi2_seq": masked_mean(_bounded_exp(2 * row_log_ratio), rows) - 1,
        "training_ppl": masked_mean((-train_row).exp(), rows),
        "rollout_ppl": masked_mean((-rollout_row).exp(), rows),
        "log_ppl_diff": masked_mean(rollout_row - train_row, rows),
    }
