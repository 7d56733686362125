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


@pytest.mark.parametrize("estimator", alg.KL_ESTIMATORS)
def test_kl_estimators(estimator):
    logp = T([-1.0, -0.2, -3.0])
    ref = T([-1.5, -0.1, -2.0])
    reference = {
        "k1": lambda p, q: p - q,
        "kl": lambda p, q: p - q,
        "abs": lambda p, q: abs(p - q),
        "k2": lambda p, q: 0.5 * (p - q) ** 2,
        "mse": lambda p, q: 0.5 * (p - q) ** 2,
        "k3": lambda p, q: math.exp(q - p) - (q - p) - 1,
        "low_var_kl": lambda p, q: math.exp(q - p) - (q - p) - 1,
    }[estimator]
    assert close(alg.kl_penalty(logp, ref, estimator), [reference(p, q) for p, q in zip(logp.tolist(), ref.tolist())])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        alg.kl_penalty(logp, ref, "k9")


@pytest.mark.parametrize(
    ("observed", "expected"),
    # target 0.1, horizon 100, 10 samples: the error is clipped to +-0.2, so one batch moves the coefficient 2% at most
    [(0.1, 0.5), (0.11, 0.5 * 1.01), (0.5, 0.5 * 1.02), (0.09, 0.5 * 0.99), (0.0, 0.5 * 0.98)],
)
def test_adaptive_kl_coef(observed, expected):
    assert alg.adaptive_kl_coef(0.5, observed, target_kl=0.1, horizon=100, n_steps=10) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", alg.LOSS_AGG_MODES)
def test_loss_aggregation_modes(mode):
    loss = torch.arange(24, dtype=torch.float64).reshape(4, 6) / 7
    rows = [[v for v, m in zip(loss[r].tolist(), MASK[r].tolist()) if m] for r in range(4)]
    expected = {
        "token-mean": sum(map(sum, rows)) / sum(map(len, rows)),
        "seq-mean-token-sum": statistics.mean(sum(r) for r in rows),
        "seq-mean-token-mean": statistics.mean(statistics.mean(r) for r in rows),
    }[mode]
    assert close(alg.aggregate_loss(loss, MASK, mode), expected)


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
    assert 0 < metrics["clipfrac"] < 1


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


def test_value_loss_and_entropy():
    values = T([[0.5, 2.0, 0.0]])
    old = T([[0.0, 0.0, 0.0]])
    returns = T([[1.0, 1.0, 5.0]])
    mask = T([[1.0, 1.0, 0.0]])
    # token 0: max(0.25, 0.25)/2; token 1: clip(2.0) = 0.5 -> max(1, 0.25)/2
    assert close(alg.value_loss(values, old, returns, mask, 0.5), (0.125 + 0.5) / 2)
    logits = T([[0.0, 0.0], [100.0, 0.0]])
    assert close(alg.entropy_from_logits(logits), [math.log(2), 0.0])


def test_rollout_importance_weights_truncate():
    old = T([[-1.0, -1.0, -1.0]])
    rollout = T([[-1.0, -2.0, -0.5]])
    weights, metrics = alg.rollout_importance_weights(old, rollout, T([[1.0, 1.0, 0.0]]), threshold=2.0)
    assert close(weights, [[1.0, 2.0, 0.0]])  # e^1 > 2 is truncated; the masked token weighs 0
    assert close(metrics["mismatch/abs_log_prob_diff"], 0.5)
    assert close(metrics["mismatch/truncated_share"], 0.5)
