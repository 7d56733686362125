"""trainer.algorithms against independent references (plain Python loops) on hand-made tensors."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer import algorithms as alg

TOL = 1e-6


def T(values):
    return torch.tensor(values, dtype=torch.float64)


MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float64)


def close(a, b):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=TOL)


def last_token_rewards(scores):
    rewards = torch.zeros_like(MASK)
    for row, score in enumerate(scores):
        rewards[row, int(MASK[row].nonzero().max())] = score
    return rewards


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantages(norm):
    scores = [1.0, 0.0, 0.5, 3.0]
    groups = ["a", "a", "b", "a"]
    advantages, returns = alg.grpo_outcome_advantage(last_token_rewards(scores), MASK, groups, norm_adv_by_std_in_grpo=norm)
    group_a = [scores[i] for i in (0, 1, 3)]
    mean, std = statistics.mean(group_a), statistics.stdev(group_a)
    expected = {0: scores[0] - mean, 1: scores[1] - mean, 3: scores[3] - mean, 2: scores[2] - 0.0}
    if norm:
        expected = {row: value / ((std if row != 2 else 1.0) + 1e-6) for row, value in expected.items()}
    for row in range(4):
        assert close(advantages[row], [expected[row] * m for m in MASK[row].tolist()])
    assert torch.equal(advantages, returns)


def reference_gae(rewards, values, mask, gamma, lam):
    """GAE on each row's model tokens only (rewards on observation tokens moved to the previous model token)."""
    advantages = [[0.0] * len(mask[0]) for _ in mask]
    returns = [[0.0] * len(mask[0]) for _ in mask]
    for row in range(len(mask)):
        positions = [t for t, m in enumerate(mask[row]) if m]
        r = [0.0] * len(positions)
        for t, reward in enumerate(rewards[row]):
            owners = [i for i, p in enumerate(positions) if p <= t]
            if owners:
                r[owners[-1]] += reward
        gae = 0.0
        for i in reversed(range(len(positions))):
            next_value = values[row][positions[i + 1]] if i + 1 < len(positions) else 0.0
            delta = r[i] + gamma * next_value - values[row][positions[i]]
            gae = delta + gamma * lam * gae
            advantages[row][positions[i]] = gae
            returns[row][positions[i]] = gae + values[row][positions[i]]
    flat = [advantages[r][t] for r in range(len(mask)) for t in range(len(mask[0])) if mask[r][t]]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    whitened = [[(advantages[r][t] - mean) / math.sqrt(var + 1e-8) * mask[r][t] for t in range(len(mask[0]))] for r in range(len(mask))]
    return whitened, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_skips_observation_tokens(gamma, lam):
    torch.manual_seed(0)
    values = torch.randn_like(MASK)
    rewards = last_token_rewards([1.0, -0.5, 2.0, 0.25])
    rewards[1, 2] = 0.3  # a step reward mid-trajectory
    advantages, returns = alg.gae_advantage_return(rewards, values, MASK, gamma, lam)
    expected_adv, expected_ret = reference_gae(rewards.tolist(), values.tolist(), MASK.tolist(), gamma, lam)
    assert close(advantages, expected_adv) and close(returns, expected_ret)


def k3(p, q):
    return math.exp(q - p) - (q - p) - 1


KL_REFERENCES = {
    "k1": lambda p, q: p - q,
    "kl": lambda p, q: p - q,
    "abs": lambda p, q: abs(p - q),
    "k2": lambda p, q: 0.5 * (p - q) ** 2,
    "mse": lambda p, q: 0.5 * (p - q) ** 2,
    "k3": k3,
    "low_var_kl": k3,
}


@pytest.mark.parametrize("estimator", alg.KL_ESTIMATORS)
def test_kl_estimators(estimator):
    logp = T([-1.0, -0.2, -3.0])
    ref = T([-1.5, -0.1, -2.0])
    reference = KL_REFERENCES[estimator.removesuffix("+")]
    assert close(alg.kl_penalty(logp, ref, estimator), [reference(p, q) for p, q in zip(logp.tolist(), ref.tolist())])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        alg.kl_penalty(logp, ref, "k9")


@pytest.mark.parametrize("estimator", ["k1+", "k3+", "low_var_kl+"])
def test_straight_through_kl_keeps_the_value_and_takes_k2s_gradient(estimator):
    p_values, q_values = [-1.0, -0.2, -3.0], [-1.5, -0.1, -2.0]
    logp = T(p_values).requires_grad_()
    value = alg.kl_penalty(logp, T(q_values), estimator)
    value.sum().backward()
    base = KL_REFERENCES[estimator.removesuffix("+")]
    assert close(value.detach(), [base(p, q) for p, q in zip(p_values, q_values)])
    # d/dp of (p - q)^2 / 2; k1's own gradient would be 1, k3's 1 - e^(q - p)
    assert close(logp.grad, [p - q for p, q in zip(p_values, q_values)])


def test_plain_k3_gradient_is_not_k2s():
    logp = T([-1.0, -3.0]).requires_grad_()
    alg.kl_penalty(logp, T([-1.5, -2.0]), "k3").sum().backward()
    assert close(logp.grad, [1 - math.exp(-0.5), 1 - math.exp(1.0)])


@pytest.mark.parametrize(
    ("observed", "expected"),
    # target 0.1, horizon 100, 10 samples: the error is clipped to +-0.2, so one batch moves the coefficient 2% at most
    [(0.1, 0.5), (0.11, 0.5 * 1.01), (0.5, 0.5 * 1.02), (0.09, 0.5 * 0.99), (0.0, 0.5 * 0.98)],
)
def test_adaptive_kl_coef(observed, expected):
    assert alg.adaptive_kl_coef(0.5, observed, target_kl=0.1, horizon=100, n_steps=10) == pytest.approx(expected, abs=1e-12)


# the last row has no model token (a failed sample, or one rejected by rollout_rs)
MASK_WITH_EMPTY_ROW = torch.cat([MASK, torch.zeros(1, 6, dtype=torch.float64)])


@pytest.mark.parametrize("mode", alg.LOSS_AGG_MODES)
@pytest.mark.parametrize("mask", [MASK, MASK_WITH_EMPTY_ROW], ids=["full", "empty_row"])
def test_loss_aggregation_modes(mode, mask):
    loss = torch.arange(mask.numel(), dtype=torch.float64).reshape(mask.shape) / 7
    rows = [[v for v, m in zip(loss[r].tolist(), mask[r].tolist()) if m] for r in range(len(mask))]
    present = [r for r in rows if r]  # verl leaves rows without model tokens out of the seq-mean modes
    expected = {
        "token-mean": sum(map(sum, rows)) / sum(map(len, rows)),
        "seq-mean-token-sum": statistics.mean(sum(r) for r in present),
        "seq-mean-token-mean": statistics.mean(statistics.mean(r) for r in present),
        "seq-mean-token-sum-norm": sum(map(sum, rows)) / 6,  # divided by the padded response length
    }[mode]
    assert close(alg.aggregate_loss(loss, mask, mode), expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    # row 1 has no model token: 2.0 = its neighbour's token sum alone (dividing by both rows gave 1.0)
    [("seq-mean-token-sum", 2.0), ("seq-mean-token-mean", 1.0), ("token-mean", 1.0), ("seq-mean-token-sum-norm", 1.0)],
)
def test_rows_without_model_tokens_leave_the_sequence_mean(mode, expected):
    assert alg.aggregate_loss(T([[1, 1], [5, 5]]), T([[1, 1], [0, 0]]), mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_by_the_constant():
    loss, mask = T([[1, 2, 3], [4, 5, 6]]), T([[1, 1, 0], [1, 0, 0]])
    assert alg.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=4).item() == pytest.approx(7 / 4)
    assert alg.aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        alg.aggregate_loss(loss, mask, "seq-sum")


def reference_ppo(old, new, adv, mask, low, high, c):
    values = []
    for r in range(len(mask)):
        for t in range(len(mask[0])):
            if not mask[r][t]:
                continue
            ratio = math.exp(new[r][t] - old[r][t])
            loss = max(-adv[r][t] * ratio, -adv[r][t] * min(max(ratio, 1 - low), 1 + high))
            if c is not None and adv[r][t] < 0:
                loss = min(loss, -adv[r][t] * c)
            values.append(loss)
    return sum(values) / len(values)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clipped_loss(dual_clip):
    torch.manual_seed(1)
    old = -torch.rand_like(MASK) * 2
    new = old + torch.randn_like(MASK) * 0.8
    adv = torch.randn_like(MASK) * 2
    loss, metrics = alg.ppo_policy_loss(old, new, adv, MASK, 0.2, 0.28, dual_clip)
    assert close(loss, reference_ppo(old.tolist(), new.tolist(), adv.tolist(), MASK.tolist(), 0.2, 0.28, dual_clip))
    assert 0 < metrics["pg_clipfrac"] < 1
    assert close(metrics["ppo_kl"], alg.masked_mean(old - new, MASK))


def test_dual_clip_is_on_by_default_at_3():
    # ratio 5 with advantage -1: the clipped surrogate keeps 5 (max(5, 1.2)), dual clip bounds it at 3
    old, new, adv, mask = T([[0.0, 0.0]]), T([[math.log(5), math.log(5)]]), T([[-1.0, 1.0]]), T([[1.0, 0.0]])
    loss, metrics = alg.ppo_policy_loss(old, new, adv, mask)
    assert loss.item() == pytest.approx(3.0) and metrics["pg_clipfrac_lower"].item() == pytest.approx(1.0)
    loss, metrics = alg.ppo_policy_loss(old, new, adv, mask, clip_ratio_c=None)
    assert loss.item() == pytest.approx(5.0) and "pg_clipfrac_lower" not in metrics
    assert alg.ppo_policy_loss.__defaults__[2] == 3.0


def test_reinforce_loss_is_minus_advantage_times_log_prob_times_weight():
    rollout, logp = T([[-1.0, -2.0, -0.5]]), T([[-1.2, -1.5, -0.5]]).requires_grad_()
    adv, mask, weights = T([[2.0, -1.0, 3.0]]), T([[1.0, 1.0, 0.0]]), T([[0.5, 2.0, 9.0]])
    loss, metrics = alg.reinforce_policy_loss(rollout, logp, adv, mask, importance_weights=weights)
    assert loss.item() == pytest.approx((-2.0 * -1.2 * 0.5 + 1.0 * -1.5 * 2.0) / 2)
    loss.backward()
    assert close(logp.grad, [[-2.0 * 0.5 / 2, 1.0 * 2.0 / 2, 0.0]])
    assert metrics["ppo_kl"].item() == pytest.approx(((-1.0 + 1.2) + (-2.0 + 1.5)) / 2)


def test_masked_tokens_get_zero_gradient():
    torch.manual_seed(2)
    old = -torch.rand_like(MASK)
    new = (old + 0.1 * torch.randn_like(MASK)).requires_grad_()
    adv = torch.randn_like(MASK)
    for mode in alg.LOSS_AGG_MODES:
        new.grad = None
        loss, _ = alg.ppo_policy_loss(old, new, adv, MASK, loss_agg_mode=mode)
        kl = alg.aggregate_loss(alg.kl_penalty(new, old, "low_var_kl"), MASK, mode)
        (loss + kl).backward()
        assert torch.all(new.grad[MASK == 0] == 0)
        assert torch.any(new.grad[MASK == 1] != 0)


def test_value_loss_clipfrac_and_entropy():
    values = T([[0.9, 0.8, 2.0, 0.0]])
    old = T([[0.0, 0.0, 0.0, 0.0]])
    returns = T([[1.0, 1.0, 1.0, 5.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    # tokens 0 and 1 clip to 0.5, and (0.5 - 1)^2 = 0.25 beats 0.01 and 0.04: the clipped term is chosen;
    # token 2 clips 2.0 to 0.5, and (2 - 1)^2 = 1 beats 0.25: the unclipped one is; token 3 is masked
    loss, metrics = alg.value_loss(values, old, returns, mask, 0.5)
    assert close(loss, 0.5 * (0.25 + 0.25 + 1.0) / 3)
    assert metrics["vf_clipfrac"].item() == pytest.approx(2 / 3)
    logits = T([[0.0, 0.0], [100.0, 0.0]])
    assert close(alg.entropy_from_logits(logits), [math.log(2), 0.0])
