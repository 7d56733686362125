"""verl's keys that mean something here take effect: token-packed micro-batches (the same gradients as any
other split, for every loss_agg_mode), gradient checkpointing and CPU offload on the FSDP ranks,
log-prob micro-batches, greedy validation, the default agent loop, the prompt column, the sglang
settings and reward functions from a file."""

from __future__ import annotations

import json

import pytest
import ray
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from agentloop.config import compose_config
from agentloop.server.sglang_engine import launch_args
from agentloop.settings import rollout_settings
from tests.support.config import small_config
from tests.support.ranks import two_ranks
from trainer.algorithms import LOSS_AGG_MODES, aggregate_loss
from trainer.config_checks import check_config
from trainer.data import load_dataset
from trainer.fsdp_workers import response_log_probs
from trainer.trainable import Trainable
from trainer.micro_batches import MicroBatching, balanced_groups, bins_needed
from trainer.rank_settings import OptimSettings, UpdateSettings
from trainer.settings import rank_settings

PROMPT, RESPONSE = 8, 8
# (prompt tokens, response tokens) per sample: unequal, so that splits differ in tokens and in samples
LENGTHS = [(8, 8), (3, 2), (6, 7), (2, 1), (5, 8), (1, 3)]


def make_batch(lengths: list[tuple[int, int]], seed: int = 0) -> TensorDict:
    """Left-padded prompts and right-padded responses, as the rollout batch has them."""
    generator = torch.Generator().manual_seed(seed)
    count = len(lengths)
    input_ids = torch.randint(1, 1000, (count, PROMPT + RESPONSE), generator=generator)
    attention = torch.zeros(count, PROMPT + RESPONSE, dtype=torch.long)
    for row, (prompt, response) in enumerate(lengths):
        attention[row, PROMPT - prompt : PROMPT + response] = 1
    zeros = torch.zeros(count, RESPONSE)
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT:],
            "response_mask": attention[:, PROMPT:],
            "advantages": torch.randn(count, RESPONSE, generator=generator),
            "old_log_probs": zeros,
            "ref_log_probs": zeros,
        },
        batch_size=[count],
    )


def test_token_packing_covers_every_sample_once_within_the_budget():
    lengths = [16, 5, 13, 3, 13, 4]
    assert bins_needed(lengths, 24) == 3 and bins_needed(lengths, 100) == 1
    assert bins_needed([30, 2], 24) == 2, "a sample over the budget gets a micro-batch of its own"
    groups = balanced_groups(lengths, 3)
    assert sorted(index for group in groups for index in group) == list(range(6))
    assert all(group and sum(lengths[i] for i in group) <= 24 for group in groups)
    assert [len(group) for group in balanced_groups([1, 1, 1], 3)] == [1, 1, 1], "no micro-batch is empty"
    batching = MicroBatching(2, dynamic=True, max_tokens=24)
    assert batching.groups(make_batch(LENGTHS)) == groups


def gradient_after_update(model_path: str, batch: TensorDict, batching: MicroBatching, mode: str) -> list[torch.Tensor]:
    """One update through the trainer's own loop; Adam's first moment after one step is 0.1 x the gradient."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainable = Trainable(model, OptimSettings(lr=1e-4, lr_warmup_steps=0), total_steps=1, role="actor")
    update = UpdateSettings(micro_batching=batching, grad_clip=1e9, loss_agg_mode=mode)

    def loss(micro: TensorDict) -> tuple[torch.Tensor, dict]:
        log_probs, _ = response_log_probs(model, micro, 1.0)
        value = aggregate_loss(-log_probs * micro["advantages"], micro["response_mask"].float(), mode)
        return value, {"loss": value}

    trainable.update(batch, update, len(batch), loss)
    return [trainable.optimizer.state[p]["exp_avg"] / 0.1 for p in model.parameters()]


# seq-mean-token-sum-norm divides by a constant, so its micro-batches are weighted by their share of the
# sequences as in verl's gradient accumulation: its gradient depends on the split by design
@pytest.mark.parametrize("mode", [mode for mode in LOSS_AGG_MODES if mode != "seq-mean-token-sum-norm"])
def test_any_micro_batch_split_gives_the_whole_batch_gradient(model_path, mode):
    batch = make_batch(LENGTHS)
    dynamic = MicroBatching(1, dynamic=True, max_tokens=30)
    assert sorted(len(group) for group in dynamic.groups(batch)) == [2, 4], "micro-batches of different sizes"
    whole = gradient_after_update(model_path, batch, MicroBatching(len(batch)), mode)
    # A split only reorders float32 sums over the batch's response tokens: each gradient element may move by up to
    # about (tokens x machine epsilon) of the largest element of its tensor (seen: 3.4 epsilons), where a wrongly
    # weighted micro-batch would move it by a share of its own size.
    tokens = int(batch["response_mask"].sum())
    for batching in (MicroBatching(4), dynamic):
        split = gradient_after_update(model_path, batch, batching, mode)
        for expected, actual in zip(whole, split):
            bound = tokens * torch.finfo(torch.float32).eps * expected.abs().max().item()
            torch.testing.assert_close(actual, expected, rtol=0, atol=bound)


@pytest.fixture(scope="module")
def ranks(local_ray):
    config = small_config(
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    )
    yield from two_ranks(config)


def _rank_state(worker) -> dict:
    def probe(self) -> dict:
        def offload(model) -> str:  # FSDP2 keeps the policy on each sharded module's parameter group
            return type(model.model.layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__

        return {
            "checkpointing": self.policy.model.is_activation_checkpointing,
            "policy": offload(self.policy.model),
            "ref": offload(self.ref),
            "parameters": str(next(self.policy.model.parameters()).device),
            "optimizer": sorted(
                {str(v.device) for s in self.policy.optimizer.state.values() for k, v in s.items() if k != "step"}
            ),
        }

    return ray.get(worker.__ray_call__.remote(probe), timeout=60)


def test_ranks_checkpoint_offload_and_pack_log_prob_micro_batches_by_tokens(ranks):
    # rank 0 gets the long samples, rank 1 the short: they need different numbers of token-packed
    # micro-batches and must agree on one, or the sharded forward passes would wait on each other forever
    long, short = make_batch([(8, 8), (7, 8), (8, 6), (6, 7)]), make_batch([(2, 1), (1, 3), (3, 2), (2, 2)], seed=1)
    plan = MicroBatching(1, dynamic=True, max_tokens=24)
    assert len(plan.groups(long)) != len(plan.groups(short))
    old = ray.get([worker.compute_log_prob.remote(half) for worker, half in zip(ranks, (long, short))], timeout=120)
    ref = ray.get(
        [worker.compute_log_prob.remote(half, reference=True) for worker, half in zip(ranks, (long, short))],
        timeout=120,
    )
    for half, packed, one_by_one in zip((long, short), old, ref):  # the same policy, scored two ways
        mask = half["response_mask"].bool()
        torch.testing.assert_close(packed[mask], one_by_one[mask], rtol=1e-5, atol=1e-5)
    updates = ray.get([worker.update_policy.remote(half) for worker, half in zip(ranks, (long, short))], timeout=120)
    assert all(torch.isfinite(torch.tensor(update["actor/pg_loss"])) for update in updates)
    for state in (_rank_state(worker) for worker in ranks):
        assert state["checkpointing"] is True
        assert (state["policy"], state["ref"]) == ("CPUOffloadPolicy", "CPUOffloadPolicy")
        assert state["parameters"] == "cpu" and state["optimizer"] == ["cpu"]


def _scores_and_update(batch: TensorDict, *overrides: str) -> tuple[torch.Tensor, list[dict], set[str]]:
    """Two fresh ranks on ``overrides``: their log-probs of ``batch`` (half each), one update's metrics, and the
    dtypes of the policy's sharded parameters and AdamW state after it."""
    ranks = two_ranks(small_config(*overrides))
    workers = next(ranks)
    try:
        halves = (batch[:3], batch[3:])
        scores = ray.get([worker.compute_log_prob.remote(half) for worker, half in zip(workers, halves)], timeout=120)
        updates = ray.get([worker.update_policy.remote(half) for worker, half in zip(workers, halves)], timeout=120)

        def dtypes(self) -> set[str]:
            state = [v for s in self.policy.optimizer.state.values() for k, v in s.items() if k != "step"]
            return {str(tensor.dtype) for tensor in [*self.policy.model.parameters(), *state]}

        return torch.cat(scores), updates, ray.get(workers[0].__ray_call__.remote(dtypes), timeout=60)
    finally:
        next(ranks, None)


def test_mixed_precision_computes_in_bf16_and_keeps_float32_weights_and_optimizer_state(local_ray):
    batch = make_batch(LENGTHS)
    mask = batch["response_mask"].bool()
    exact, _, _ = _scores_and_update(batch)
    mixed, updates, dtypes = _scores_and_update(
        batch, "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf16, reduce_dtype: fp32}"
    )
    gap = (mixed - exact)[mask].abs().max().item()
    assert 1e-4 < gap < 0.25, f"bf16 compute is close to float32, and not float32 itself: {gap}"
    assert all(update["actor/grad_norm"] > 0 for update in updates)
    assert dtypes == {"torch.float32"}, "the shards and AdamW's moments stay float32"


def test_mixed_precision_names_its_key_on_a_bad_dtype():
    config = small_config("actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: bf8}")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype='bf8'"):
        rank_settings(config)


def test_do_sample_false_decodes_greedily_and_multi_turn_enable_picks_tool_agent():
    rollout = rollout_settings(compose_config(["actor_rollout_ref.rollout.val_kwargs.temperature=0.7"]))
    assert rollout.sampling_params(validate=True)["temperature"] == 0.0, "val_kwargs.do_sample defaults to false"
    assert rollout.sampling_params(validate=False)["temperature"] == 1.0
    rollout = rollout_settings(
        compose_config(
            [
                "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
                "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                "actor_rollout_ref.rollout.do_sample=false",
            ]
        )
    )
    assert (
        rollout.sampling_params(validate=True)["temperature"],
        rollout.sampling_params(validate=False)["temperature"],
    ) == (0.7, 0.0)

    def default_agent_loop(*overrides: str) -> str:
        return rollout_settings(compose_config(list(overrides))).agent.default_agent_loop

    assert default_agent_loop() == "single_turn_agent"
    assert default_agent_loop("actor_rollout_ref.rollout.multi_turn.enable=true") == "tool_agent"
    explicit = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=env_agent",
    ]
    assert default_agent_loop(*explicit) == "env_agent"


def test_prompt_key_names_the_column_of_chat_messages(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": [{"role": "user", "content": "2 + 2?"}], "data_source": "x"}) + "\n")
    [row] = load_dataset([str(rows)], prompt_key="question")
    assert row == {"prompt": [{"role": "user", "content": "2 + 2?"}], "data_source": "x"}
    with pytest.raises(ValueError, match=r"row 0: no 'problem' column \(data.prompt_key\)"):
        load_dataset([str(rows)], prompt_key="problem")


def test_verls_rollout_keys_set_the_sglang_launch_flags():
    config = compose_config(
        [
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_torch_compile=true",
        ]
    )
    flags = launch_args(rollout_settings(config).servers, rank=1)
    assert flags[flags.index("--tp-size") + 1] == "2" and flags[flags.index("--mem-fraction-static") + 1] == "0.85"
    assert flags[flags.index("--attention-backend") + 1] == "triton" and "--enable-torch-compile" in flags
    with pytest.raises(ValueError, match="the hf engine has no tensor parallelism"):
        check_config(compose_config(["data.train_files=[x]", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))


def test_padding_that_every_row_has_is_not_computed(model_path):
    from trainer.vision import model_inputs

    batch = make_batch(
        [(prompt - 3, response) for prompt, response in LENGTHS if prompt > 3]
    )  # every prompt >= 3 pads short
    extra = 40
    widened = batch.clone()
    for key in ("input_ids", "attention_mask", "position_ids"):
        pad = (
            torch.randint(1, 1000, (len(batch), extra))
            if key == "input_ids"
            else torch.zeros(len(batch), extra, dtype=torch.long)
        )
        widened[key] = torch.cat([pad, batch[key]], dim=1)
    assert model_inputs(widened)["input_ids"].shape[1] == PROMPT + RESPONSE - 3
    # and as many columns of right padding on every response (a longer data.max_response_length)
    right = TensorDict(
        {
            key: torch.cat([value, torch.zeros(len(batch), extra, dtype=value.dtype)], dim=1)
            for key, value in widened.items()
            if key != "position_ids"
        },
        batch_size=[len(batch)],
    )
    right["position_ids"] = torch.cat(
        [widened["position_ids"], widened["position_ids"][:, -1:] + torch.arange(1, extra + 1)], dim=1
    )
    assert model_inputs(right)["input_ids"].shape[1] == PROMPT + RESPONSE - 3
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        expected, computed, padded = (response_log_probs(model, b, 1.0)[0] for b in (batch, widened, right))
    mask = batch["response_mask"].bool()
    assert torch.allclose(computed[mask], expected[mask], atol=1e-5)
    assert padded.shape == right["responses"].shape and torch.equal(padded[:, :RESPONSE], computed)
    assert not padded[:, RESPONSE:].any()
