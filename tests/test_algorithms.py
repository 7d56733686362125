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


MASK = torch.tensor(
    [[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float64
)


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
    advantages, returns = alg.grpo_outcome_advantage(
        last_token_rewards(scores), MASK, groups, norm_adv_by_std_in_grpo=norm
    )
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
    whitened = [
        [(advantages[r][t] - mean) / math.sqrt(var + 1e-8) * mask[r][t] for t in range(len(mask[0]))]
        for r in range(len(mask))
    ]
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


# ---------------------------------------------------------------------- per-turn rewards and turn-level estimators
# One GRPO group "g" of three trajectories, A's context rewritten (two rows), and a group "h" of one (D).
#   A: row 0 = turn 0 (2 tokens), its observation (2), turn 1 (1 token); row 1 = turn 2 (2 tokens). Score 1.0; turn 0
#      reported 0.5 and turn 2 0.2 (on the last token: the score's place), so r = [0.5, 0, 1.0 - 0.5 = 0.5].
#   B: turn 0 (1 token), observation, turn 1 (1), observation, turn 2 (2). Score 0.0; turn 1 reported 0.5: r = [0, 0.5, -0.5].
#   C: turn 0 (2 tokens), observation, turn 1 (2). Score 0.25; turn 0 reported 0.25: r = [0.25, 0].
#   D: one turn of 3 tokens, score 2.0.
TURN_MASK = T([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1], [1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
TURN_INDEX = torch.tensor(
    [[0, 0, 0, 0, 1, -1], [2, 2, -1, -1, -1, -1], [0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, -1], [0, 0, 0, -1, -1, -1]]
)
TURN_SEGMENTS = torch.tensor([0, 1, 0, 0, 0])
TURN_GROUPS = ["g", "g", "g", "h"]  # one per trajectory
SCORES = T(
    [[0, 0, 0, 0, 0, 0], [0, 1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0.0], [0, 0, 0, 0, 0.25, 0], [0, 0, 2.0, 0, 0, 0]]
)
OWN = T([[0, 0.5, 0, 0, 0, 0], [0, 0.2, 0, 0, 0, 0], [0, 0, 0.5, 0, 0, 0], [0, 0.25, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
DISTRIBUTED = T(
    [[0, 0.5, 0, 0, 0, 0], [0, 0.5, 0, 0, 0, 0], [0, 0, 0.5, 0, 0, -0.5], [0, 0.25, 0, 0, 0.0, 0], [0, 0, 2.0, 0, 0, 0]]
)
TRAJECTORY_OF_ROW = [0, 0, 1, 2, 3]


def on_turn_tokens(per_turn):
    """{(trajectory, turn): advantage} on the model tokens of each turn, as a [B, R] tensor."""
    expected = torch.zeros_like(TURN_MASK)
    for row, trajectory in enumerate(TRAJECTORY_OF_ROW):
        for position in range(TURN_MASK.shape[1]):
            if TURN_MASK[row, position]:
                expected[row, position] = per_turn[trajectory, int(TURN_INDEX[row, position])]
    return expected


def normalised(values):
    """(x - mean) / (std + 1e-6) of each of a set of values (a set of one: mean 0, std 1)."""
    if len(values) == 1:
        return [values[0] / (1 + 1e-6)]
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(value - mean) / (std + 1e-6) for value in values]


def test_turn_rewards_distribute_the_score_over_the_turns():
    rewards = alg.turn_token_rewards(SCORES, OWN, TURN_MASK, TURN_SEGMENTS)
    assert close(rewards, DISTRIBUTED)
    assert close(alg.trajectory_sums(rewards.sum(-1), TURN_SEGMENTS), [1.0, 0.0, 0.25, 2.0])  # still the scores
    # a KL-in-reward penalty stays on its tokens
    penalty = 0.01 * TURN_MASK
    assert close(alg.turn_token_rewards(SCORES - penalty, OWN, TURN_MASK, TURN_SEGMENTS), DISTRIBUTED - penalty)


# returns-to-go with gamma 0.5: G_t = r_t + 0.5 G_(t+1)
RETURNS = {
    (0, 0): 0.625,
    (0, 1): 0.25,
    (0, 2): 0.5,
    (1, 0): 0.125,
    (1, 1): 0.25,
    (1, 2): -0.5,
    (2, 0): 0.25,
    (2, 1): 0.0,
    (3, 0): 2.0,
}


def test_turn_returns_discount_over_turns():
    returns, present = alg.turn_returns(DISTRIBUTED, TURN_INDEX, 0.5, TURN_SEGMENTS)
    assert present.tolist() == [[True, True, True], [True, True, True], [True, True, False], [True, False, False]]
    assert all(close(returns[key], value) for key, value in RETURNS.items())


@pytest.mark.parametrize("normalize", ["per_turn", "pooled"])
def test_turn_grpo_normalises_turn_returns_within_the_group(normalize):
    advantages, _ = alg.turn_grpo_advantage(
        DISTRIBUTED, TURN_INDEX, TURN_MASK, TURN_GROUPS, 0.5, normalize, segment_index=TURN_SEGMENTS
    )
    sets = (
        [[(0, t), (1, t), (2, t)][: 3 if t < 2 else 2] for t in range(3)]
        if normalize == "per_turn"
        else [[key for key in RETURNS if key[0] < 3]]
    )
    expected = torch.zeros(4, 3, dtype=torch.float64)
    for keys in [*sets, [(3, 0)]]:
        for key, value in zip(keys, normalised([RETURNS[key] for key in keys])):
            expected[key] = value
    assert close(advantages, on_turn_tokens(expected))
    if normalize == "per_turn":  # by hand: turn 2's returns 0.5 and -0.5 have mean 0 and std 1/sqrt(2)
        assert close(advantages[1, 0], 0.5 / (math.sqrt(0.5) + 1e-6)) and close(
            advantages[2, 4], -0.5 / (math.sqrt(0.5) + 1e-6)
        )


def verl_agent_gigpo(steps, gamma, step_weight, by_std, cross_steps):
    """GiGPO as verl-agent computes it (gigpo/core_gigpo.py), on its own layout: one row per step, (episode group uid,
    trajectory, anchor state, step reward), each trajectory's rows in order; a trajectory's score (its episode reward,
    on each of its rows) is the sum of its step rewards. Each row's advantage, episode term + weight x step term."""
    step_returns = [0.0] * len(steps)  # compute_step_discounted_returns (Eq. 5)
    following = {}
    for row in reversed(range(len(steps))):
        _, trajectory, _, reward = steps[row]
        following[trajectory] = step_returns[row] = reward + gamma * following.get(trajectory, 0.0)
    score = {trajectory: 0.0 for _, trajectory, _, _ in steps}
    for _, trajectory, _, reward in steps:
        score[trajectory] += reward

    def normalise(value, pool, lone_mean):
        mean, std = (lone_mean, 1.0) if len(pool) == 1 else (statistics.mean(pool), statistics.stdev(pool))
        return (value - mean) / (std + 1e-6) if by_std else value - mean

    # episode_norm_reward (Eq. 3): a row's score joins its uid's pool once per row (cross steps) or once per trajectory
    episode_pools, seen = {}, set()
    for uid, trajectory, _, _ in steps:
        if cross_steps or (uid, trajectory) not in seen:
            episode_pools.setdefault(uid, []).append(score[trajectory])
            seen.add((uid, trajectory))
    # build_step_group (Eq. 6): the rows of one uid with the same anchor state; step_norm_reward (Eq. 7): a group of
    # one has its own return as mean
    step_pools = {}
    for (uid, _, anchor, _), step_return in zip(steps, step_returns):
        step_pools.setdefault((uid, anchor), []).append(step_return)
    return [
        normalise(score[trajectory], episode_pools[uid], 0.0)
        + step_weight * normalise(step_return, step_pools[(uid, anchor)], step_return)
        for (uid, trajectory, anchor, _), step_return in zip(steps, step_returns)
    ]


# the turn-level fixture's turns (A, B, C in group g, D alone in h), with revisits: A [p, x, p], B [p, p, x], C [p, x]
FIXTURE_STATES = [["p", "x", "p"], ["p", "p", "x"], ["p", "x"], ["p"]]
FIXTURE_TURN_REWARDS = [[0.5, 0.0, 0.5], [0.0, 0.5, -0.5], [0.25, 0.0], [2.0]]


@pytest.mark.parametrize("by_std", [True, False], ids=["mean_std_norm", "mean_norm"])
@pytest.mark.parametrize("episode_normalize", ["steps", "trajectories"])
def test_gigpo_is_verl_agents_on_revisited_states_and_unequal_lengths(by_std, episode_normalize):
    steps = [
        (TURN_GROUPS[trajectory], trajectory, state, reward)
        for trajectory, (states, rewards) in enumerate(zip(FIXTURE_STATES, FIXTURE_TURN_REWARDS))
        for state, reward in zip(states, rewards)
    ]
    expected_rows = verl_agent_gigpo(steps, 0.5, 0.7, by_std, cross_steps=episode_normalize == "steps")
    per_turn = torch.zeros(4, 3, dtype=torch.float64)
    turn_of_row = [turn for states in FIXTURE_STATES for turn in range(len(states))]
    for (_, trajectory, _, _), turn, advantage in zip(steps, turn_of_row, expected_rows):
        per_turn[trajectory, turn] = advantage
    advantages, returns = alg.gigpo_advantage(
        DISTRIBUTED,
        TURN_INDEX,
        TURN_MASK,
        TURN_GROUPS,
        FIXTURE_STATES,
        0.7,
        0.5,
        by_std,
        segment_index=TURN_SEGMENTS,
        episode_normalize=episode_normalize,
    )
    assert close(advantages, on_turn_tokens(per_turn)) and torch.equal(advantages, returns)


def one_row_per_trajectory(turn_rewards):
    """Token tensors for trajectories of one row each: every turn two model tokens, its reward on the second, then one
    observation token (none after the last turn). (rewards, turn_index, response_mask)"""
    length = max(3 * len(rewards) - 1 for rewards in turn_rewards)
    rewards = torch.zeros(len(turn_rewards), length, dtype=torch.float64)
    turn_index = torch.full((len(turn_rewards), length), -1)
    mask = torch.zeros_like(rewards)
    for row, trajectory_rewards in enumerate(turn_rewards):
        for turn, reward in enumerate(trajectory_rewards):
            span = slice(3 * turn, min(3 * turn + 3, 3 * len(trajectory_rewards) - 1))
            turn_index[row, span] = turn
            mask[row, 3 * turn : 3 * turn + 2] = 1
            rewards[row, 3 * turn + 1] = reward
    return rewards, turn_index, mask


def test_gigpo_pools_a_revisit_of_the_first_state_with_the_first_turns():
    """Issue 48's case: A visits s0 -> s0 with turn rewards [0, 1], B visits s0 -> y with [0, 0]; gamma 1, mean only.
    Episode: 1 - 1/2 = 1/2. A's second turn shares s0's step group with both first turns: returns [1, 1, 0], mean
    2/3, so 1/2 + 1/3 = 0.8333 (verl-agent's value; pooled without the first turns it would be 1/2 + 0)."""
    rewards, turn_index, mask = one_row_per_trajectory([[0.0, 1.0], [0.0, 0.0]])
    states, groups = [["s0", "s0"], ["s0", "y"]], ["g", "g"]
    advantages, _ = alg.gigpo_advantage(
        rewards, turn_index, mask, groups, states, gamma=1.0, norm_adv_by_std_in_grpo=False
    )
    per_turn = {(0, 0): 0.5 + 1 / 3, (0, 1): 0.5 + 1 / 3, (1, 0): -0.5 - 2 / 3, (1, 1): -0.5 + 0.0}  # y: alone, 0
    for (row, turn), value in per_turn.items():
        assert close(advantages[row][(turn_index[row] == turn) & (mask[row] > 0)], [value, value])
    assert close(advantages[0, 3:5], [5 / 6, 5 / 6])
    # first_turn_step_advantage=False: first turns keep the episode term alone, A's revisit is still pooled with them
    advantages, _ = alg.gigpo_advantage(
        rewards,
        turn_index,
        mask,
        groups,
        states,
        gamma=1.0,
        norm_adv_by_std_in_grpo=False,
        first_turn_step_advantage=False,
    )
    assert close(advantages[0, :2], [0.5, 0.5]) and close(advantages[0, 3:5], [5 / 6, 5 / 6])
    assert close(advantages[1, :2], [-0.5, -0.5]) and close(advantages[1, 3:5], [-0.5, -0.5])


def test_gigpos_episode_statistics_count_each_trajectory_once_per_step():
    """Group g of A (3 turns, score 1), B (3 turns, 0), C (2 turns, 0.25), and a lone E of two turns (score 1); every
    later state distinct and first turns without step advantage, so each turn gets the episode term alone."""
    rewards, turn_index, mask = one_row_per_trajectory([[0, 0, 1.0], [0, 0, 0], [0, 0.25], [0.5, 0.5]])
    states = [["p", "a1", "a2"], ["p", "b1", "b2"], ["p", "c1"], ["q", "e1"]]
    groups = ["g", "g", "g", "solo"]

    def episode_terms(episode_normalize):
        advantages, _ = alg.gigpo_advantage(
            rewards,
            turn_index,
            mask,
            groups,
            states,
            norm_adv_by_std_in_grpo=False,
            episode_normalize=episode_normalize,
            first_turn_step_advantage=False,
        )
        assert all(len(set(advantages[row][mask[row] > 0].tolist())) == 1 for row in range(4))
        return advantages[:, 0].tolist()

    # over steps: g's mean (3 x 1 + 3 x 0 + 2 x 0.25) / 8 = 0.4375; E's pool is [1, 1], mean 1
    assert close(episode_terms("steps"), [0.5625, -0.4375, -0.1875, 0.0])
    # over trajectories: g's mean 1.25 / 3; E is a group of one (mean 0)
    assert close(episode_terms("trajectories"), [1 - 1.25 / 3, -1.25 / 3, 0.25 - 1.25 / 3, 1.0])
    with pytest.raises(ValueError, match="episode_normalize='turns'; choose one of"):
        alg.gigpo_advantage(rewards, turn_index, mask, groups, states, episode_normalize="turns")


def test_gae_takes_each_turns_reward_on_its_last_model_token():
    # C alone: its turn 0's 0.25 on token 1, the rest of its score (0) on its last model token
    rewards = alg.turn_token_rewards(SCORES[3:4], OWN[3:4], TURN_MASK[3:4])
    torch.manual_seed(0)
    values = torch.randn(1, 6, dtype=torch.float64)
    advantages, returns = alg.gae_advantage_return(rewards, values, TURN_MASK[3:4], 0.9, 0.8)
    expected_adv, expected_ret = reference_gae(
        [[0, 0.25, 0, 0, 0.0, 0]], values.tolist(), TURN_MASK[3:4].tolist(), 0.9, 0.8
    )
    assert close(advantages, expected_adv) and close(returns, expected_ret)


@pytest.mark.parametrize("by_std", [True, False])
def test_with_one_turn_every_estimator_is_todays_exactly(by_std):
    """One turn per trajectory (a two-row one too), a KL-like penalty on every model token and the turn's own reward on
    its last token: turn_grpo (both normalisations) and gigpo (without first-turn step advantages) are grpo, gae is the
    outcome-only gae, bit for bit."""
    mask = torch.tensor(
        [[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32
    )
    segment_index = torch.tensor([0, 0, 1, 0, 0])
    turn_index = torch.where(mask > 0, 0, -1)
    turn_index[0, 2] = 0  # an observation of the turn
    torch.manual_seed(1)
    rewards = -0.013 * torch.rand(mask.shape) * mask
    for row, (position, score) in {0: (3, 0.7), 2: (2, 0.3), 3: (0, 1.0), 4: (1, 0.1)}.items():
        rewards[row, position] += score
    own = torch.zeros_like(mask)
    own[0, 3], own[2, 2] = 0.1, 0.3  # reported on the turn's (the trajectory's) last token
    groups = ["a", "a", "a", "b"]
    grpo, _ = alg.grpo_outcome_advantage(rewards, mask, groups, by_std, segment_index=segment_index)
    distributed = alg.turn_token_rewards(rewards, own, mask, segment_index)
    assert torch.equal(distributed, rewards)
    for normalize in alg.TURN_NORMALIZATIONS:
        turn_grpo, _ = alg.turn_grpo_advantage(
            distributed, turn_index, mask, groups, 0.9, normalize, by_std, segment_index=segment_index
        )
        assert torch.equal(turn_grpo, grpo)
    states = [["s"], ["s"], ["s"], ["s"]]
    for episode_normalize in alg.GIGPO_EPISODE_NORMALIZATIONS:
        gigpo, _ = alg.gigpo_advantage(
            distributed,
            turn_index,
            mask,
            groups,
            states,
            1.0,
            0.9,
            by_std,
            segment_index=segment_index,
            episode_normalize=episode_normalize,
            first_turn_step_advantage=False,
        )
        assert torch.equal(gigpo, grpo)
    # verl-agent's GiGPO steps from the first turns too: their step group is the episode group, so (1 + omega) x GRPO
    # for group a (rows 0-3); b is alone (a step group of one: 0)
    gigpo, _ = alg.gigpo_advantage(
        distributed, turn_index, mask, groups, states, 0.5, 0.9, by_std, segment_index=segment_index
    )
    assert torch.allclose(gigpo, grpo * torch.tensor([1.5, 1.5, 1.5, 1.5, 1.0])[:, None], atol=1e-6)
    values = torch.randn(mask.shape)
    gae = alg.gae_advantage_return(distributed, values, mask, 0.9, 0.8, segment_index)
    assert all(
        torch.equal(a, b) for a, b in zip(gae, alg.gae_advantage_return(rewards, values, mask, 0.9, 0.8, segment_index))
    )


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
    assert alg.adaptive_kl_coef(0.5, observed, target_kl=0.1, horizon=100, n_steps=10) == pytest.approx(
        expected, abs=1e-12
    )


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
