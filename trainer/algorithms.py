"""PPO/GRPO math on padded response tensors: pure functions, no state.

Shapes: ``[B, R]`` for per-token quantities (B rows, R response positions). ``response_mask``
is 1 on model tokens and 0 on observation and padding tokens; every loss and statistic here is masked
by it, so observation tokens carry no gradient.

A row is one segment of a trajectory (``agentloop.postprocess``): ``segment_index [B]`` is 0 where a trajectory
starts and numbers its later rows. The advantages take it (optional: without it every row is a trajectory of its
own); the losses treat every row as a sequence of its own.

Turn-level estimators (``turn_grpo``, ``gigpo``) read the batch's ``turn_index [B, R]`` (each response token's model
turn; -1 on padding) and take each turn's reward r_t as the sum of the token rewards on its tokens, after
``turn_token_rewards`` has put each turn's own reward on its last model token.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence

import torch

from agentloop.batch import trajectory_ids

ADV_ESTIMATORS = ("grpo", "gae", "turn_grpo", "gigpo")
TURN_NORMALIZATIONS = ("per_turn", "pooled")  # algorithm.turn_grpo.normalize
GIGPO_EPISODE_NORMALIZATIONS = ("steps", "trajectories")  # algorithm.gigpo.episode_normalize
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_BASE_KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
# "<name>+": the estimator's value with k2's gradient (verl's straight-through variants, e.g. k1+ and k3+)
KL_ESTIMATORS = _BASE_KL_ESTIMATORS + tuple(f"{name}+" for name in _BASE_KL_ESTIMATORS)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the positions where ``mask`` is 1 (0 when there are none)."""
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise to zero mean and unit variance over the masked positions (unbiased variance)."""
    mean = masked_mean(values, mask)
    count = mask.sum().clamp(min=2)
    variance = (((values - mean) ** 2) * mask).sum() / (count - 1)
    return (values - mean) * torch.rsqrt(variance + eps) * mask


def trajectory_sums(row_values: torch.Tensor, segment_index: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row values ``[B]`` summed over each trajectory's rows, ``[trajectories]`` in batch order (without
    ``segment_index``: the values themselves)."""
    if segment_index is None:
        return row_values
    trajectory = trajectory_ids(segment_index).to(row_values.device)
    return row_values.new_zeros(int(trajectory[-1]) + 1).index_add_(0, trajectory, row_values)


def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[str],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    segment_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each trajectory's total reward (over all its rows' tokens), normalised within its group (same prompt,
    same ``uid``; ``group_ids`` has one per trajectory, one per row without ``segment_index``).

    advantage = (score - group mean) / (group std + epsilon), or score - group mean without std
    normalisation (Dr. GRPO). A group of one has mean 0 and std 1. Returns (advantages, returns),
    both broadcast over the model tokens of every row of the trajectory.
    """
    scores = trajectory_sums(token_level_rewards.sum(dim=-1), segment_index)
    normalised = _normalise_within(scores, group_ids, norm_adv_by_std_in_grpo, epsilon)
    if segment_index is not None:
        normalised = normalised[trajectory_ids(segment_index)]
    advantages = normalised.unsqueeze(-1) * response_mask
    return advantages, advantages


def _normalise_within(
    values: torch.Tensor, keys: Sequence[Hashable], by_std: bool, epsilon: float, lone_to_zero: bool = False
) -> torch.Tensor:
    """Each value less the mean of the values sharing its key, divided by their std + epsilon when ``by_std``; a key
    held by one value alone has mean 0 and std 1 (GRPO's group of one), or gives 0 when ``lone_to_zero``."""
    members: dict[Hashable, list[int]] = defaultdict(list)
    for position, key in enumerate(keys):
        members[key].append(position)
    mean = torch.zeros_like(values)
    std = torch.ones_like(values)
    for positions in members.values():
        if len(positions) > 1:
            group_values = values[positions]
            mean[positions] = group_values.mean()
            std[positions] = group_values.std()
        elif lone_to_zero:
            mean[positions] = values[positions]
    centred = values - mean
    return centred / (std + epsilon) if by_std else centred


def turn_token_rewards(
    token_level_rewards: torch.Tensor,
    turn_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    segment_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token rewards with the score distributed over the turns: each turn's own reward (``turn_rewards``, on its
    last model token) stays where it is, and the trajectory's last model token, where its score R sits, keeps
    R - the sum of the other turns' rewards. So r_t = the turn's reward for every turn but the last, and the last
    turn's r_T = its own reward + whatever part of R no turn reported: a trajectory's rewards still sum to R.

    ``token_level_rewards`` is ``rm_scores`` (less a KL-in-reward penalty, which stays on its tokens). A trajectory
    with one turn, or whose turns report nothing, keeps ``token_level_rewards`` exactly. (The last model token is where
    ``rm_scores`` sits whenever a trajectory ends on a model token, as every built-in loop's does; a reward on a later
    observation token counts for the last turn, and GAE carries it to that token anyway.)
    """
    last = _last_model_tokens(response_mask, segment_index)
    moved = turn_rewards.masked_fill(last, 0.0).to(token_level_rewards.dtype)
    taken = trajectory_sums(moved.sum(dim=-1), segment_index)  # [trajectories]
    rows = trajectory_ids(segment_index) if segment_index is not None else torch.arange(len(moved), device=moved.device)
    rewards = token_level_rewards + moved
    rewards[last] = rewards[last] - taken[rows[last.nonzero()[:, 0]]]
    return rewards


def _last_model_tokens(response_mask: torch.Tensor, segment_index: torch.Tensor | None) -> torch.Tensor:
    """``[B, R]`` True on each trajectory's last model token (in its last row that has one)."""
    length = response_mask.shape[1]
    position = torch.where(response_mask > 0, torch.arange(length, device=response_mask.device), -1).amax(dim=-1)
    rows = torch.arange(len(response_mask), device=response_mask.device)
    if segment_index is None:
        last_rows = rows[position >= 0]
    else:
        trajectory = trajectory_ids(segment_index).to(rows.device)
        candidate = torch.where(position >= 0, rows, -1)
        last_rows = candidate.new_full((int(trajectory[-1]) + 1,), -1).scatter_reduce(0, trajectory, candidate, "amax")
        last_rows = last_rows[last_rows >= 0]
    last = torch.zeros(response_mask.shape, dtype=torch.bool, device=response_mask.device)
    last[last_rows, position[last_rows]] = True
    return last


def turn_returns(
    token_level_rewards: torch.Tensor,
    turn_index: torch.Tensor,
    gamma: float = 1.0,
    segment_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each trajectory's turn rewards as returns-to-go: ``[trajectories, turns]`` G_t = r_t + gamma * G_next, r_t the
    sum of the token rewards on turn t's tokens (``turn_index``), G_next that of its next turn (0 after its last), and
    which turns it has. A turn without tokens (aborted before its first) is skipped, not discounted; every trajectory
    has a first turn (one without a response scores 0 there, as GRPO scores it)."""
    count = max(int(turn_index.max()) + 1, 1)
    rewards = torch.stack(
        [trajectory_sums((token_level_rewards * (turn_index == t)).sum(dim=-1), segment_index) for t in range(count)],
        dim=1,
    )
    present = torch.stack(
        [trajectory_sums((turn_index == t).sum(dim=-1), segment_index) > 0 for t in range(count)], dim=1
    )
    present[:, 0] = True
    returns = torch.zeros_like(rewards)
    following = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(count)):
        returns[:, t] = torch.where(present[:, t], rewards[:, t] + gamma * following, following)
        following = returns[:, t]
    return returns, present


def _on_turn_tokens(
    per_turn: torch.Tensor, turn_index: torch.Tensor, response_mask: torch.Tensor, segment_index: torch.Tensor | None
) -> torch.Tensor:
    """``[trajectories, turns]`` values on the model tokens of each turn, ``[B, R]``."""
    rows = trajectory_ids(segment_index) if segment_index is not None else torch.arange(len(turn_index))
    return per_turn[rows.to(per_turn.device)[:, None], turn_index.clamp(min=0)] * response_mask


def turn_grpo_advantage(
    token_level_rewards: torch.Tensor,
    turn_index: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[str],
    gamma: float = 1.0,
    normalize: str = "per_turn",
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    segment_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GRPO: each turn's return-to-go G_t = sum_{k >= t} gamma^(k-t) r_k (``turn_returns``) normalised
    within the trajectory's group, on all of that turn's model tokens.

    ``normalize=per_turn``: A_t = (G_t - mean) / (std + epsilon) over the group's trajectories that reached turn t
    (``turn_index`` t); ``pooled``: over all turns of all the group's trajectories. A set of one has mean 0 and std 1,
    as in GRPO; without ``norm_adv_by_std_in_grpo``, A_t = G_t - mean. With one turn, its return is the score: GRPO exactly.
    ``token_level_rewards`` should come from ``turn_token_rewards``. Returns (advantages, advantages).
    """
    if normalize not in TURN_NORMALIZATIONS:
        raise ValueError(f"algorithm.turn_grpo.normalize={normalize!r}; choose one of {TURN_NORMALIZATIONS}")
    returns, present = turn_returns(token_level_rewards, turn_index, gamma, segment_index)
    entries = present.nonzero().tolist()  # (trajectory, turn), in the order returns[present] lists them
    keys = [(group_ids[i], t) if normalize == "per_turn" else group_ids[i] for i, t in entries]
    per_turn = torch.zeros_like(returns)
    per_turn[present] = _normalise_within(returns[present], keys, norm_adv_by_std_in_grpo, epsilon)
    advantages = _on_turn_tokens(per_turn, turn_index, response_mask, segment_index)
    return advantages, advantages


def gigpo_advantage(
    token_level_rewards: torch.Tensor,
    turn_index: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[str],
    state_keys: Sequence[Sequence[Hashable | None]],
    step_weight: float = 1.0,
    gamma: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    segment_index: torch.Tensor | None = None,
    episode_normalize: str = "steps",
    first_turn_step_advantage: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"): A_t = A^E + omega * A^S_t,
    by default as its authors compute it (``verl-agent``, ``gigpo/core_gigpo.py``).

    A^E: the trajectory's score R (over all its rows' tokens) less the mean of its group's scores, divided by their
    std + epsilon when ``norm_adv_by_std_in_grpo`` (their ``mean_std_norm``; without it, their ``mean_norm``). With
    ``episode_normalize=steps`` (theirs) the group's mean and std count each trajectory's score once per turn, as
    their batch holds one row per step; ``trajectories``: once per trajectory, GRPO's statistics. A set of one score
    has mean 0 and std 1 (so a lone trajectory keeps R if it has one turn, and gets 0 with more under ``steps``).

    A^S_t: turn t's return-to-go G_t (``turn_returns``, discount ``gamma``) normalised the same way within its step
    group: every turn of the group's trajectories that answered the same environment state
    (``state_keys[trajectory][turn]``, ``TurnRecord.state_key``), first turns and revisits alike. A step group of one
    and a turn without a state key get A^S = 0. ``first_turn_step_advantage=False`` gives first turns A^S = 0 (they
    still count in their state's step group): first turns answer the prompt the whole group shares, so their step
    group is the episode group again, and with one turn GiGPO becomes GRPO exactly rather than (1 + omega) x GRPO.
    ``omega`` is ``step_weight``. Returns (advantages, advantages).
    """
    if episode_normalize not in GIGPO_EPISODE_NORMALIZATIONS:
        raise ValueError(
            f"algorithm.gigpo.episode_normalize={episode_normalize!r}; choose one of {GIGPO_EPISODE_NORMALIZATIONS}"
        )
    by_std = norm_adv_by_std_in_grpo
    returns, present = turn_returns(token_level_rewards, turn_index, gamma, segment_index)
    scores = trajectory_sums(token_level_rewards.sum(dim=-1), segment_index)
    episode = _gigpo_episode_advantage(scores, present, group_ids, episode_normalize, by_std, epsilon)
    rows = trajectory_ids(segment_index) if segment_index is not None else torch.arange(len(episode))
    episode_on_tokens = episode[rows.to(episode.device)].unsqueeze(-1) * response_mask

    entries = [(i, t) for i, t in present.nonzero().tolist() if t < len(state_keys[i]) and state_keys[i][t] is not None]
    step = torch.zeros_like(returns)
    if entries:
        trajectories, turns = torch.tensor(entries).T
        keys = [(group_ids[i], state_keys[i][t]) for i, t in entries]
        step[trajectories, turns] = _normalise_within(
            returns[trajectories, turns], keys, by_std, epsilon, lone_to_zero=True
        )
    if not first_turn_step_advantage:
        step[:, 0] = 0.0
    advantages = episode_on_tokens + step_weight * _on_turn_tokens(step, turn_index, response_mask, segment_index)
    return advantages, advantages


def _gigpo_episode_advantage(
    scores: torch.Tensor,
    present: torch.Tensor,
    group_ids: Sequence[str],
    episode_normalize: str,
    by_std: bool,
    epsilon: float,
) -> torch.Tensor:
    """A^E per trajectory: its score normalised within its group, each score counted once per turn (``steps``) or
    once per trajectory (``trajectories``)."""
    if episode_normalize != "steps":
        return _normalise_within(scores, group_ids, by_std, epsilon)
    # each trajectory's score once per turn it took, as verl-agent's rows list them (compute_mean_std_cross_steps)
    steps = present.sum(dim=1).to(scores.device)
    group_of_each_step = [group_ids[i] for i, count in enumerate(steps.tolist()) for _ in range(count)]
    per_step = _normalise_within(scores.repeat_interleave(steps), group_of_each_step, by_std, epsilon)
    return per_step[steps.cumsum(0) - steps]  # each trajectory's first entry (all of its entries are equal)


def gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    segment_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over model tokens only.

    Observation tokens are skipped: the TD step goes from one model token to the next model token,
    so a tool result between them neither adds a value estimate nor decays the return. A trajectory's
    segments chain in order (``segment_index``): the TD step from a segment's last model token goes to the next
    segment's first, as if its response rows were one. Returns (advantages whitened over all model tokens,
    returns = raw advantages + values), zero outside the mask.
    """
    if segment_index is None:
        segment_index = torch.zeros(len(values), dtype=torch.long, device=values.device)
    rows = _chained_rows(segment_index)
    chained = _gae(_chain(token_level_rewards, rows), _chain(values, rows), _chain(response_mask, rows), gamma, lam)
    # back to one row per segment: a trajectory's rows are consecutive and oldest first, as they are chained
    advantages = chained.unflatten(1, (rows.shape[1], -1))[rows >= 0]
    returns = (advantages + values) * response_mask
    return masked_whiten(advantages, response_mask), returns


def _chained_rows(segment_index: torch.Tensor) -> torch.Tensor:
    """``[trajectories, most segments]``: each trajectory's rows in order, then -1 (no row)."""
    trajectory = trajectory_ids(segment_index)
    rows = segment_index.new_full((int(trajectory[-1]) + 1, int(segment_index.max()) + 1), -1)
    rows[trajectory, segment_index] = torch.arange(len(segment_index), device=segment_index.device)
    return rows


def _chain(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` per-row values as one row per trajectory, its rows side by side (zeros where it has fewer)."""
    padded = torch.cat([values, torch.zeros_like(values[:1])])  # row -1: zeros, masked out
    return padded[rows].flatten(1)


def _gae(
    token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Raw GAE advantages along each row's model tokens (zero elsewhere)."""
    batch, length = token_level_rewards.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros_like(next_value)
    # rewards sitting on observation tokens are carried to the preceding model token
    pending_reward = torch.zeros_like(next_value)
    for t in reversed(range(length)):
        model = response_mask[:, t].to(values.dtype)
        reward = token_level_rewards[:, t] + pending_reward
        delta = reward + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        advantages[:, t] = gae * model
        last_gae = gae * model + last_gae * (1 - model)
        next_value = values[:, t] * model + next_value * (1 - model)
        pending_reward = reward * (1 - model)
    return advantages


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens' log-probs.

    ``k1`` (verl's ``kl``): log p - log q; ``abs``: |k1|; ``k2``/``mse``: (k1)^2 / 2; ``k3``/``low_var_kl``:
    q/p - log(q/p) - 1 (non-negative, low variance; clamped to [-10, 10] as is customary). A trailing ``+``
    (``k1+``, ``k3+``, ...) keeps the value and replaces the gradient by k2's, log p - log q.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
    value = _kl_value(log_prob, ref_log_prob, estimator.removesuffix("+"))
    if not estimator.endswith("+"):
        return value
    # k1 and k3 estimate the KL without bias, but their gradients do not estimate its gradient; k2's does
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return value.detach() + (k2 - k2.detach())


def _kl_value(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    diff = log_prob - ref_log_prob
    if estimator in ("k1", "kl"):
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator in ("k2", "mse"):
        return 0.5 * diff.square()
    log_ratio = (ref_log_prob - log_prob).clamp(-20, 20)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)


def adaptive_kl_coef(coef: float, observed_kl: float, target_kl: float, horizon: float, n_steps: int) -> float:
    """The KL coefficient after one batch under the adaptive controller of Ziegler et al. (2019).

    The coefficient moves towards keeping ``observed_kl`` at ``target_kl``: multiplied by
    ``1 + e * n_steps / horizon`` where the proportional error ``e = observed_kl / target_kl - 1`` is clipped
    to [-0.2, 0.2], so a batch of ``n_steps`` samples changes it by at most ``0.2 * n_steps / horizon``.
    """
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", loss_scale_factor: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar, as verl's ``loss_agg_mode``s do.

    ``token-mean``: over all model tokens. ``seq-mean-token-sum`` / ``seq-mean-token-mean``: each row's
    token sum / mean, then the mean over the rows that have a model token. ``seq-mean-token-sum-norm``:
    the sum of all rows' token sums divided by the constant ``loss_scale_factor`` (default: the padded
    response length ``R``).
    """
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    row_sums = (loss * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum-norm":
        # a constant divisor: a row's weight grows with its length, the same in every batch (Dr. GRPO)
        return row_sums.sum() / (loss_scale_factor or mask.shape[-1])
    row_tokens = mask.sum(dim=-1)
    per_row = row_sums if mode == "seq-mean-token-sum" else row_sums / row_tokens.clamp(min=1)
    # a row without model tokens (a failed sample, or one rollout_rs rejected) would dilute the mean
    return masked_mean(per_row, (row_tokens > 0).to(loss.dtype))


def ppo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    importance_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, dual-clipped as in verl: ``clip_ratio_c`` (> 1; None: off) bounds the loss of
    tokens with negative advantages at -A x clip_ratio_c.

    ``importance_weights`` (detached, e.g. truncated rollout/train ratios) multiply the per-token loss.
    Returns the loss and verl's metrics (unprefixed): ``pg_clipfrac``, ``ppo_kl`` (mean log old - log new),
    and with dual clip ``pg_clipfrac_lower``.
    """
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
        lower = -advantages * clip_ratio_c
        dual = torch.minimum(loss, lower)
        metrics["pg_clipfrac_lower"] = masked_mean(((loss > lower) & (advantages < 0)).float(), response_mask)
        loss = torch.where(advantages < 0, dual, loss)
    if importance_weights is not None:
        loss = loss * importance_weights.detach()
    return aggregate_loss(loss, response_mask, loss_agg_mode, loss_scale_factor), metrics


def reinforce_policy_loss(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    importance_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain policy gradient, -A x log p (x a detached importance weight), with no ratio and no clipping.

    verl's ``rollout_correction.loss_type=reinforce`` in bypass mode. Returns the loss and ``ppo_kl``
    against the rollout policy.
    """
    loss = -advantages * log_prob
    if importance_weights is not None:
        loss = loss * importance_weights.detach()
    metrics = {"ppo_kl": masked_mean(rollout_log_prob - log_prob, response_mask)}
    return aggregate_loss(loss, response_mask, loss_agg_mode, loss_scale_factor), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's clipped squared error: 0.5 * max((v - R)^2, (clip(v, v_old ± c) - R)^2).

    Returns the loss and ``vf_clipfrac``: the share of model tokens where the clipped term was the larger.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error, clipped_error = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    clipfrac = masked_mean((clipped_error > unclipped_error).float(), response_mask)
    return aggregate_loss(loss, response_mask, loss_agg_mode), {"vf_clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the softmax distribution (computed in at least fp32)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)
