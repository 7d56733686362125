"""trainer.rollout_correction (verl's algorithm.rollout_correction) against hand-computed values and plain-Python
re-derivations; its config keys and checks; and the policy-gradient term it feeds in the FSDP worker."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from tests.support.config import small_config
from trainer import rollout_correction as rc
from trainer.config_checks import check_config
from trainer.fsdp_workers import has_dropout, policy_gradient_loss
from trainer.rank_settings import ActorSettings
from trainer.settings import rank_settings, rollout_correction


def T(values):
    return torch.tensor(values, dtype=torch.float64)


# log π_train - log π_rollout per token; row 2 has no model token
LOG_RATIO = [[0.0, 1.0, -1.0, 0.5], [0.2, 0.3, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]


def settings(**section):
    return rollout_correction(small_config(*(f"algorithm.rollout_correction.{k}={v}" for k, v in section.items())))


def per_token(function):
    return [[function(r, m) for r, m in zip(row, mask_row)] for row, mask_row in zip(LOG_RATIO, MASK)]


def test_token_weights_are_truncated_ratios():
    weights, metrics = rc.importance_weights(T(LOG_RATIO), T(MASK), "token", threshold=2.0)
    assert torch.allclose(weights, T(per_token(lambda r, m: min(math.exp(r), 2.0) * m)))
    ratios = [math.exp(r) for row, mask_row in zip(LOG_RATIO, MASK) for r, m in zip(row, mask_row) if m]
    assert metrics["rollout_is_ratio_fraction_high"].item() == pytest.approx(sum(r > 2 for r in ratios) / len(ratios))
    assert metrics["rollout_is_ratio_fraction_low"].item() == pytest.approx(sum(r < 0.5 for r in ratios) / len(ratios))
    assert metrics["rollout_is_mean"].item() == pytest.approx(sum(ratios) / len(ratios))
    assert metrics["rollout_is_max"].item() == pytest.approx(math.e)


def test_sequence_weights_are_the_truncated_product_over_the_row():
    weights, metrics = rc.importance_weights(T(LOG_RATIO), T(MASK), "sequence", threshold=2.0)
    # row 0: e^(0 + 1 - 1 + 0.5) = 1.65; row 1: e^0.5 = 1.65; row 2 has no token (the masked 3.0s count for nothing)
    expected = [[min(math.exp(0.5), 2.0)] * 4, [math.exp(0.5)] * 2 + [0, 0], [0.0] * 4]
    assert torch.allclose(weights, T(expected))
    assert metrics["rollout_is_ratio_fraction_high"].item() == 0.0


def test_batch_normalisation_rescales_to_mean_one():
    token, metrics = rc.importance_weights(T(LOG_RATIO), T(MASK), "token", threshold=2.0, batch_normalize=True)
    truncated = [min(math.exp(r), 2.0) for row, mask_row in zip(LOG_RATIO, MASK) for r, m in zip(row, mask_row) if m]
    mean = sum(truncated) / len(truncated)
    assert torch.allclose(token, T(per_token(lambda r, m: min(math.exp(r), 2.0) * m / mean)))
    assert metrics["rollout_is_batch_norm_factor"].item() == pytest.approx(mean)
    # sequence level: the mean is over rows (two with tokens), not over tokens (four and two)
    log_ratio = [[math.log(3.0)] * 4, [math.log(0.5), 0.0, 0.0, 0.0], [0.0] * 4]
    sequence, _ = rc.importance_weights(T(log_ratio), T(MASK), "sequence", threshold=2.0, batch_normalize=True)
    row_mean = (2.0 + 0.5) / 2
    assert torch.allclose(sequence, T([[2.0 / row_mean] * 4, [0.5 / row_mean] * 2 + [0, 0], [0.0] * 4]))


def test_token_k1_rejection_keeps_ratios_within_the_bounds():
    bounds = settings(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0").rejection_bounds
    mask, metrics = rc.rejection_mask(T(LOG_RATIO), T(MASK), bounds)
    # ratios e^1 = 2.7 and e^-1 = 0.37 leave [0.5, 2]
    assert torch.equal(mask, T([[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]]))
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(2 / 6)
    assert metrics["rollout_rs_seq_masked_fraction"].item() == pytest.approx(1 / 3)
    # k1 bounds apply to π_rollout / π_train = e^-log r, as in verl: e^-0.5 = 0.61 is within [0.5, 1.2], e^0.5 is not
    bounds = settings(rollout_rs="token_k1", rollout_rs_threshold="0.5_1.2").rejection_bounds
    mask, _ = rc.rejection_mask(T([[0.0, 0.5, -0.5, 0.0]]), T([[1, 1, 1, 1]]), bounds)
    assert mask.tolist() == [[1, 1, 0, 1]]


def test_sequence_rejection_modes_drop_whole_rows():
    log_ratio = T([[0.1, 0.1, 0.1, 0.1], [0.0, 0.9, 0.0, 0.0], [0.0] * 4])
    mask = T(MASK)
    # seq_sum_k1 = -(row sum): 0.4 and 0.9 in ratio terms e^-0.4 = 0.67 and e^-0.9 = 0.41; bound 2.0 means [0.5, 2]
    kept, _ = rc.rejection_mask(
        log_ratio, mask, settings(rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0).rejection_bounds
    )
    assert torch.equal(kept, T([MASK[0], [0, 0, 0, 0], MASK[2]]))
    # seq_mean_k3, the row mean of r - 1 - log r: row 0 e^0.1 - 1.1 = 0.0052, row 1 (0 + e^0.9 - 1.9) / 2 = 0.28
    for bound, expected in ((0.1, [MASK[0], [0, 0, 0, 0], MASK[2]]), (0.3, MASK), (0.005, [[0] * 4, [0] * 4, MASK[2]])):
        kept, _ = rc.rejection_mask(
            log_ratio, mask, settings(rollout_rs="seq_mean_k3", rollout_rs_threshold=bound).rejection_bounds
        )
        assert torch.equal(kept, T(expected)), bound
    # seq_max_k2: the row's largest (log r)^2 / 2 is 0.005 and 0.405
    kept, _ = rc.rejection_mask(
        log_ratio, mask, settings(rollout_rs="seq_max_k2", rollout_rs_threshold=0.1).rejection_bounds
    )
    assert torch.equal(kept, T([MASK[0], [0, 0, 0, 0], MASK[2]]))


def test_rejection_options_combine_and_thresholds_pair_up():
    bounds = settings(rollout_rs="'token_k1,seq_max_k2'", rollout_rs_threshold="'0.5_2.0,0.2'").rejection_bounds
    assert bounds == {"token_k1": (math.log(0.5), math.log(2.0)), "seq_max_k2": (None, 0.2)}
    kept, metrics = rc.rejection_mask(T(LOG_RATIO), T(MASK), bounds)
    # row 0's largest k2 is 0.5 > 0.2: the whole row goes; row 1 stays
    assert torch.equal(kept, T([[0, 0, 0, 0], MASK[1], MASK[2]]))
    assert metrics["rollout_rs_token_k1_masked_fraction"].item() == pytest.approx(2 / 6)
    assert metrics["rollout_rs_seq_max_k2_masked_fraction"].item() == pytest.approx(4 / 6)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"rollout_rs": "seq_geo", "rollout_rs_threshold": 2.0},
            "rollout_rs='seq_geo'; comma-separated options from .*token_k1",
        ),
        ({"rollout_rs": "token_k3"}, "rollout_rs needs algorithm.rollout_correction.rollout_rs_threshold"),
        ({"rollout_rs": "token_k3", "rollout_rs_threshold": "0.5_2.0"}, "k1 options take"),
        ({"rollout_rs": "'token_k1,token_k3'", "rollout_rs_threshold": "'1,2,3'"}, "one per option"),
        ({"rollout_is": "geometric"}, "rollout_is='geometric'; choose null, token or sequence"),
        ({"rollout_is": "token", "rollout_is_threshold": 0}, "rollout_is_threshold must be > 0"),
        ({"loss_type": "reinforce"}, "only applies with algorithm.rollout_correction.bypass_mode=true"),
        ({"bypass_mode": "true", "loss_type": "a2c"}, "loss_type='a2c'"),
    ],
)
def test_unsupported_settings_are_named_at_config_time(section, message):
    with pytest.raises(ValueError, match=message):
        settings(**section)


def test_the_older_token_tis_keys_map_onto_rollout_is_token():
    assert settings() == rc.RolloutCorrection()  # off by default
    for key in ("rollout_is_threshold=3.0", "tis_imp_ratio_cap=3.0"):
        mapped = rollout_correction(small_config(f"actor_rollout_ref.actor.{key}"))
        assert (mapped.rollout_is, mapped.rollout_is_threshold) == ("token", 3.0)
    assert rollout_correction(small_config("actor_rollout_ref.actor.tis_imp_ratio_cap=-1")).rollout_is is None
    with pytest.raises(ValueError, match="drop actor_rollout_ref.actor.tis_imp_ratio_cap"):
        rollout_correction(
            small_config(
                "actor_rollout_ref.actor.tis_imp_ratio_cap=3", "algorithm.rollout_correction.rollout_is=sequence"
            )
        )
    with pytest.raises(ValueError, match="to different values"):
        rollout_correction(
            small_config(
                "actor_rollout_ref.actor.tis_imp_ratio_cap=3", "actor_rollout_ref.actor.rollout_is_threshold=2"
            )
        )


def test_config_defaults_follow_verl_and_bad_loss_settings_fail_the_check():
    config = small_config("data.train_files=[x.jsonl]")
    assert config.actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert (
        small_config("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean").critic.loss_agg_mode
        == "seq-mean-token-mean"
    )
    check_config(config)
    for override, message in [
        ("actor_rollout_ref.actor.clip_ratio_c=1.0", r"clip_ratio_c=1.0: must be > 1; set it above 1 \(dual-clip"),
        ("actor_rollout_ref.actor.loss_agg_mode=seq-sum", "loss_agg_mode='seq-sum'"),
        ("critic.loss_agg_mode=sum", "critic.loss_agg_mode='sum'"),
        ("actor_rollout_ref.actor.loss_scale_factor=0", "loss_scale_factor=0: must be > 0"),
        ("algorithm.rollout_correction.rollout_rs=token_k9", "rollout_rs='token_k9'"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_config(small_config("data.train_files=[x.jsonl]", override))


def test_offpolicy_metrics():
    train, rollout, mask = (
        T([[-1.0, -2.0, -9.0], [-0.5, -3.0, -3.0]]),
        T([[-1.5, -1.0, 0.0], [-0.5, -3.0, -3.0]]),
        T([[1, 1, 0], [0, 0, 0]]),
    )
    metrics = rc.offpolicy_metrics(train, rollout, mask)
    log_ratios = [0.5, -1.0]
    assert metrics["kl"].item() == pytest.approx(0.25)
    assert metrics["abs_log_prob_diff"].item() == pytest.approx(0.75)
    assert metrics["k3_kl"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in log_ratios) / 2)
    assert metrics["chi2_token"].item() == pytest.approx(sum(math.exp(2 * x) for x in log_ratios) / 2 - 1)
    assert metrics["chi2_seq"].item() == pytest.approx(math.exp(2 * -0.5) - 1)  # the row without tokens is left out
    assert metrics["training_ppl"].item() == pytest.approx(math.exp(1.5))
    assert metrics["rollout_ppl"].item() == pytest.approx(math.exp(1.25))


def test_correct_batch_adds_weights_and_narrows_the_mask_before_the_advantages():
    rollout = -torch.ones(3, 4)
    batch = TensorDict(
        {
            "old_log_probs": rollout + T(LOG_RATIO).float(),
            "rollout_log_probs": rollout,
            "response_mask": torch.tensor(MASK),
        },
        batch_size=[3],
    )
    metrics = rc.correct_batch(
        batch, settings(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    )
    assert batch["response_mask"].dtype == torch.long
    assert batch["response_mask"].tolist() == [[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert torch.allclose(batch["rollout_is_weights"], T(per_token(lambda r, m: min(math.exp(r), 2.0) * m)).float())
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)
    assert metrics["rollout_corr/kl"] == pytest.approx(
        -sum(r for row, mr in zip(LOG_RATIO, MASK) for r, m in zip(row, mr) if m) / 6
    )


ACTOR = ActorSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)  # token-mean, no scale factor


def micro_batch(**extra):
    old = T([[-1.0, -1.0, -1.0]])
    return TensorDict(
        {
            "old_log_probs": old,
            "advantages": T([[1.0, -1.0, 2.0]]),
            "response_mask": torch.tensor([[1, 1, 0]]),
            **extra,
        },
        [1],
    )


def test_decoupled_ppo_multiplies_by_the_batch_weights():
    log_probs = T([[-1.0, -1.0, -1.0]])  # ratio 1: the surrogate is -A per token
    loss, mask, _ = policy_gradient_loss(
        micro_batch(rollout_is_weights=T([[0.5, 2.0, 7.0]])), log_probs, ACTOR, rc.RolloutCorrection()
    )
    assert loss.item() == pytest.approx((-1.0 * 0.5 + 1.0 * 2.0) / 2)
    assert mask.tolist() == [[1, 1, 0]]


def test_bypass_mode_corrects_against_the_current_policy():
    log_probs = T([[-1.0 + math.log(3.0), -1.0, -1.0]]).requires_grad_()  # token 0: ratio 3 against the rollout
    reinforce = settings(bypass_mode="true", loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0)
    loss, _, stats = policy_gradient_loss(micro_batch(), log_probs, ACTOR, reinforce)
    # -A log p x min(ratio, 2): token 0 weighs 2, token 1 weighs 1
    assert loss.item() == pytest.approx((-1.0 * (-1.0 + math.log(3.0)) * 2.0 + 1.0 * -1.0 * 1.0) / 2)
    assert stats["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    # ppo_clip: the ratio itself (clipped at 1.2 for A > 0) carries the correction, the weights are not applied
    ppo = settings(bypass_mode="true", rollout_is="token", rollout_is_threshold=2.0)
    loss, _, stats = policy_gradient_loss(micro_batch(), log_probs, ACTOR, ppo)
    assert loss.item() == pytest.approx((-1.0 * 1.2 + 1.0 * 1.0) / 2)
    assert stats["actor/ppo_kl"].item() == pytest.approx(-math.log(3.0) / 2)
    # rejection narrows the mask that every loss term uses
    rejecting = settings(bypass_mode="true", rollout_rs="token_k1", rollout_rs_threshold=2.0)
    loss, mask, _ = policy_gradient_loss(micro_batch(), log_probs, ACTOR, rejecting)
    assert mask.tolist() == [[0, 1, 0]] and loss.item() == pytest.approx(1.0)


def test_the_update_scores_old_log_probs_only_when_one_step_and_row_by_row_weights_allow():
    def scores_in_update(*overrides, batch_size=8):
        config = small_config("actor_rollout_ref.rollout.n=2", *overrides)
        ranks = rank_settings(config)
        kl_in_reward = config.algorithm.use_kl_in_reward
        return rc.old_log_probs_in_update(
            ranks.actor.update, ranks.samples_per_prompt, kl_in_reward, rollout_correction(config), batch_size
        )

    assert scores_in_update()  # one epoch over one mini-batch (null: the whole batch)
    assert scores_in_update(
        "algorithm.rollout_correction.rollout_is=sequence", "actor_rollout_ref.actor.ppo_mini_batch_size=4"
    )
    assert not scores_in_update("actor_rollout_ref.actor.ppo_mini_batch_size=2")  # two optimizer steps
    assert not scores_in_update("actor_rollout_ref.actor.ppo_epochs=2")
    assert not scores_in_update("algorithm.use_kl_in_reward=true")  # the reward needs them before the update
    assert not scores_in_update(
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_batch_normalize=true"
    )
    assert not scores_in_update(
        "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"
    )
    assert not scores_in_update("algorithm.rollout_correction.bypass_mode=true")


def test_dropout_in_a_module_or_a_config_is_seen():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    assert not has_dropout(Qwen3ForCausalLM(config))
    config.attention_dropout = 0.1  # applied inside the attention function in training mode: no module to find
    assert has_dropout(Qwen3ForCausalLM(config))
    model = Qwen3ForCausalLM(Qwen3Config(**{**config.to_dict(), "attention_dropout": 0.0}))
    model.lm_head = torch.nn.Sequential(torch.nn.Dropout(0.2), model.lm_head)
    assert has_dropout(model)


def test_weight_extremes_over_micro_batches_and_ranks_are_extremes_not_means():
    from trainer.ray_trainer import _mean_over_ranks
    from trainer.trainable import _accumulate

    # two micro-batches of one row each: weights e^0, e^1, e^-1, e^0.5 and e^0.2, e^0.3
    per_micro_batch = [
        rc.importance_weights(T([row]), T([mask]), "token", 3.0)[1] for row, mask in zip(LOG_RATIO[:2], MASK[:2])
    ]
    rank = {}
    for stats in per_micro_batch:
        _accumulate(rank, stats, len(per_micro_batch))
    assert rank["rollout_is_max"] == pytest.approx(math.e) and rank["rollout_is_min"] == pytest.approx(math.exp(-1))
    combined = _mean_over_ranks([rank, {"rollout_is_max": 1.5, "rollout_is_min": 0.1, "rollout_is_mean": 1.0}, {}])
    assert combined["rollout_is_max"] == pytest.approx(math.e) and combined["rollout_is_min"] == pytest.approx(0.1)
    assert combined["rollout_is_mean"] == pytest.approx((rank["rollout_is_mean"] + 1.0) / 2)


def test_samples_without_rollout_log_probs_fail_a_correction_and_otherwise_log_no_correction_metrics():
    from agentloop.batch import RolloutBatch, object_array
    from trainer.ray_trainer import _has_rollout_log_probs

    fields = {
        "agent_name": object_array(["mine", "from_verl"]),
        "rollout_log_probs_missing": object_array([False, True]),
    }
    rollout = RolloutBatch(TensorDict({}, batch_size=[2]), fields)
    assert not _has_rollout_log_probs(rollout, required=False)  # the step trains, without rollout_corr/* metrics
    with pytest.raises(ValueError, match=r"agent loops \['from_verl'\] returned no response_logprobs"):
        _has_rollout_log_probs(rollout, required=True)
    fields["rollout_log_probs_missing"] = object_array([False, False])
    assert _has_rollout_log_probs(rollout, required=True)
