"""LoRA (``actor_rollout_ref.model.lora_rank``) through the real stack: two FSDP ranks (gloo) training a ``peft``
adapter against an unsharded ``peft`` model doing the same step, the adapter-disabled reference policy, adapter
pushes to two ``hf`` servers, checkpoints in PEFT's format, and the configuration errors."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray
import requests
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from agentloop.dumps import read_rollout_dump
from agentloop.protocol import TokenOutput
from agentloop.rows import write_rows
from agentloop.server.adapters import PackedAdapter
from agentloop.server.vllm_engine import VLLMEngine, launch_args, server_env
from agentloop.settings import rollout_settings
from agentloop.tasks.arithmetic.data import make_rows
from tests.support.config import small_config
from tests.support.ranks import manager_and_two_ranks, scores
from tests.test_hf_engine import teacher_forced_logprobs
from trainer import algorithms
from trainer.config_checks import check_config
from trainer.fsdp_workers import push_weights, response_log_probs
from trainer.lora import LoraSettings, gather_adapter, pack_adapter
from trainer.main_ppo import run
from trainer.micro_batches import split_trajectories, trajectory_sizes

ROWS = [{"prompt": [{"role": "user", "content": f"question number {i}"}]} for i in range(4)]
LR, KL_COEF = 1e-2, 0.1
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


@pytest.fixture(scope="module")
def setup(local_ray):
    config = small_config(
        *LORA,
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.data_parallel_size=2",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",  # one micro-batch per rank: its metrics are its half's
    )
    yield from manager_and_two_ranks(config)


def adapter_of(actors) -> PackedAdapter:
    """The ranks' adapter as the push sends it (a collective; rank 0 returns it)."""
    adapter, other = ray.get([actor.packed_state_dict.remote() for actor in actors], timeout=120)
    assert isinstance(adapter, PackedAdapter) and other is None
    return adapter


def unsharded(manager, adapter: PackedAdapter) -> PeftModel:
    """The policy's base with ``adapter``, in one process, unsharded."""
    base = AutoModelForCausalLM.from_pretrained(manager.config.actor_rollout_ref.model.path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    set_peft_model_state_dict(model, adapter.weights.tensors())
    return model


def halves(batch):
    return split_trajectories(batch, len(trajectory_sizes(batch)) // 2)


def test_the_reference_policy_is_the_base_and_kl_is_zero_at_step_0(setup):
    manager, actors = setup
    batch = manager.generate_sequences(ROWS).batch
    mask = batch["response_mask"].bool()
    policy = scores(actors, batch)
    reference = torch.cat(
        ray.get([actor.compute_log_prob.remote(half, reference=True) for actor, half in zip(actors, halves(batch))])
    )
    # a new adapter's lora_B is zero: the adapted policy is the base, exactly
    assert torch.equal(policy[mask], reference[mask])
    assert float(algorithms.kl_penalty(policy, reference, "low_var_kl")[mask].abs().max()) == 0.0
    assert torch.allclose(policy[mask], batch["rollout_log_probs"][mask], atol=1e-4)


def local_step(model: PeftModel, train, config, adapter_index: int | None = None) -> tuple[list[float], float]:
    """The ranks' step on one unsharded model: each rank's half is a token-mean loss (PPO + KL to the adapter-off
    base), FSDP averages the halves' gradients; then clipping and AdamW. With ``adapter_index`` (several adapters),
    each half contributes only its rows of that adapter. Returns the halves' PPO losses and the gradient norm."""
    actor = config.actor_rollout_ref.actor
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=float(actor.optim.weight_decay))
    losses = []
    for half in halves(train):
        if adapter_index is not None:
            half = half[half["adapter_index"] == adapter_index]
            if not len(half):
                continue
        log_probs = response_log_probs(model, half, float(config.actor_rollout_ref.rollout.temperature))[0]
        mask = half["response_mask"].float()
        pg_loss = algorithms.ppo_policy_loss(
            half["old_log_probs"], log_probs, half["advantages"], mask, 0.2, 0.2, actor.clip_ratio_c
        )[0]
        kl = algorithms.aggregate_loss(
            algorithms.kl_penalty(log_probs, half["ref_log_probs"], actor.kl_loss_type), mask
        )
        ((pg_loss + KL_COEF * kl) / 2).backward()
        losses.append(float(pg_loss))
    norm = float(torch.nn.utils.clip_grad_norm_(trained, float(actor.grad_clip)))
    optimizer.step()
    return losses, norm


def test_one_step_on_the_sharded_adapter_equals_the_same_step_on_an_unsharded_peft_model(setup):
    manager, actors = setup
    before = adapter_of(actors)
    batch = manager.generate_sequences(ROWS).batch
    train = batch.clone()
    train["old_log_probs"] = scores(actors, batch)
    train["ref_log_probs"] = train["old_log_probs"].clone()
    train["advantages"] = torch.where(torch.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * train["response_mask"]
    metrics = ray.get([actor.update_policy.remote(half) for actor, half in zip(actors, halves(train))], timeout=120)
    after = adapter_of(actors)

    model = unsharded(manager, before)
    losses, norm = local_step(model, train, manager.config)
    assert [m["actor/pg_loss"] for m in metrics] == pytest.approx(losses, rel=1e-5, abs=1e-7)
    assert metrics[0]["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    trained = unsharded(manager, after)
    expected = dict(model.named_parameters())
    moved = [name for name, value in trained.named_parameters() if value.requires_grad]
    assert moved and all(torch.allclose(trained.get_parameter(n), expected[n], atol=1e-6) for n in moved)
    assert any(not torch.equal(before.weights.tensors()[k], v) for k, v in after.weights.tensors().items())


def greedy(server, prompt: list[int]) -> TokenOutput:
    params = {"temperature": 0.0, "max_new_tokens": 12}
    return ray.get(server.generate.remote(prompt, params, str(uuid.uuid4())), timeout=120)


def test_an_adapter_push_makes_every_server_serve_the_merged_policy(setup):
    manager, actors = setup
    adapter = adapter_of(actors)
    push_weights(actors, manager, 120, version=7)
    model = unsharded(manager, adapter).eval()
    prompts = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45], [7, 7, 7]]

    def expected(prompt: list[int]) -> list[int]:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        return tokens[0, len(prompt) :].tolist()

    served = [[greedy(server, prompt).token_ids for server in manager.pool.servers] for prompt in prompts]
    assert served == [[expected(prompt)] * 2 for prompt in prompts]
    # sampled turns are scored by the servers as the trainer's adapted policy scores them, not as the base does
    batch = manager.generate_sequences(ROWS).batch
    mask = batch["response_mask"].bool()
    policy, served_log_probs = scores(actors, batch)[mask], batch["rollout_log_probs"][mask]
    base = torch.cat(
        ray.get([actor.compute_log_prob.remote(half, reference=True) for actor, half in zip(actors, halves(batch))])
    )[mask]
    assert torch.allclose(served_log_probs, policy, atol=1e-4)
    assert float((served_log_probs - base).abs().max()) > 1e-3
    # a second push merges into the kept base weights, not into the merged ones: the same adapter serves the same
    push_weights(actors, manager, 120, version=8)
    outputs = [greedy(server, prompts[0]) for server in manager.pool.servers]
    assert [output.token_ids for output in outputs] == served[0]
    assert [output.policy_version for output in outputs] == [8, 8]


def test_checkpoint_saves_the_adapter_in_peft_format_and_resume_restores_it(setup, tmp_path):
    manager, actors = setup
    ray.get(
        [
            actor.save_checkpoint.remote(str(tmp_path / "workers"), str(tmp_path / "actor" / "huggingface"))
            for actor in actors
        ],
        timeout=120,
    )
    saved = adapter_of(actors)
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(manager.config.actor_rollout_ref.model.path),
        tmp_path / "actor" / "lora_adapter",
    )
    expected = unsharded(manager, saved)
    assert all(torch.equal(loaded.get_parameter(name), value) for name, value in expected.named_parameters())

    batch = manager.generate_sequences(ROWS).batch
    train = batch.clone()
    train["old_log_probs"] = scores(actors, batch)
    train["ref_log_probs"] = train["old_log_probs"].clone()
    train["advantages"] = torch.ones_like(train["old_log_probs"]) * train["response_mask"]

    def update():
        return ray.get([actor.update_policy.remote(half) for actor, half in zip(actors, halves(train))], timeout=120)[0]

    after_save = update()
    ray.get([actor.load_checkpoint.remote(str(tmp_path / "workers")) for actor in actors], timeout=120)
    restored = adapter_of(actors).weights.tensors()
    assert all(torch.equal(value, restored[name]) for name, value in saved.weights.tensors().items())
    # Adam's moments and the schedule came back too: the next update repeats the one after the save
    assert update() == pytest.approx(after_save, rel=1e-4, abs=1e-6)


def lora_settings(*overrides: str) -> LoraSettings:
    return LoraSettings.from_config(small_config(*overrides))


def test_bad_lora_settings_are_refused_naming_the_key(model_path, tmp_path):
    path = str(model_path)
    with pytest.raises(
        ValueError, match=r"model.target_modules names \['gate', 'foo_proj'\], which the model .* lacks"
    ):
        lora_settings(*LORA, "actor_rollout_ref.model.target_modules=[q_proj,gate,foo_proj]").check_model(path)
    with pytest.raises(ValueError, match=r"model.target_modules: Target modules .* not found"):
        lora_settings(*LORA, "actor_rollout_ref.model.target_modules=nothing_.*").check_model(path)
    with pytest.raises(ValueError, match=r"model.lora_rank: rank 48 is above the width of .*_proj \(\d+ -> 32\)"):
        lora_settings("actor_rollout_ref.model.lora_rank=48").check_model(path)
    with pytest.raises(ValueError, match=r"model.lora_adapter_path='.*nowhere': is not a PEFT adapter directory"):
        check_config(small_config(f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'nowhere'}"))
    with pytest.raises(ValueError, match=r"model.lora_rank=-1: must be at least 0"):
        check_config(small_config("actor_rollout_ref.model.lora_rank=-1"))
    with pytest.raises(ValueError, match=r"rollout.weight_sync=disk: with LoRA each push is the adapter alone"):
        check_config(small_config(*LORA, "actor_rollout_ref.rollout.weight_sync=disk"))
    lora_settings(*LORA).check_model(path)  # the tests' shape fits
    assert not lora_settings().enabled


def test_a_job_with_a_target_module_the_model_lacks_fails_before_any_server_starts(local_ray, tmp_path):
    train = write_rows(make_rows(4), str(tmp_path / "t.jsonl"))
    config = small_config(*LORA, f"data.train_files=[{train}]", "actor_rollout_ref.model.target_modules=[qkv_proj]")
    free = ray.available_resources().get("CPU")  # (this module's servers hold theirs throughout)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.target_modules names \['qkv_proj'\]") as error:
        run(config)
    assert type(error.value) is ValueError  # raised here, not on a rank (a RayTaskError)
    assert ray.available_resources().get("CPU") == free, "no server was started (nor a rank: they start together)"


def random_adapter(model_path, seed: int) -> tuple[PackedAdapter, torch.nn.Module]:
    """A rank-4 adapter with random (non-zero) factors, as the push sends it, and its merged model."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    adapter = pack_adapter(model, gather_adapter(model))
    return adapter, model.merge_and_unload().eval()


def test_vllm_loads_each_pushed_adapter_through_its_lora_routes_and_unloads_the_previous(model_path):
    from tests.test_vllm_engine import vllm_overrides

    settings = rollout_settings(small_config(*vllm_overrides(), *LORA)).servers
    assert "--enable-lora" in launch_args(settings, 0) and server_env(settings)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    engine = VLLMEngine.from_settings(settings, rank=0)
    prompt, params = list(range(3, 30)), {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}

    async def serve(adapters):
        served = []
        for index, adapter in enumerate(adapters):
            assert await engine.update_adapter(adapter) == len(adapter.scalings)
            served.append(await engine.generate(prompt, params, f"lora-{index}"))
        models = await asyncio.to_thread(requests.get, engine.url + "/v1/models", timeout=30)
        return served, [entry["id"] for entry in models.json()["data"]]

    try:
        (first, first_model), (second, second_model) = random_adapter(model_path, 1), random_adapter(model_path, 2)
        served, models = asyncio.run(serve([first, second]))
    finally:
        asyncio.run(engine.shutdown())
    for output, model in zip(served, [first_model, second_model]):
        reference = teacher_forced_logprobs(model, prompt, output.token_ids)
        assert torch.allclose(torch.tensor(output.log_probs), reference, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert not torch.allclose(
        torch.tensor(served[1].log_probs), teacher_forced_logprobs(base, prompt, served[1].token_ids), atol=1e-2
    )
    # the first adapter was unloaded: the server lists its base model and the adapter it serves now
    assert len(models) == 2 and sum(name.startswith("agentloop-lora-") for name in models) == 1


def test_a_job_starting_from_an_adapter_samples_its_first_rollouts_from_it(local_ray, model_path, tmp_path):
    """``lora_adapter_path``: the servers get the loaded adapter before the first rollout, so step 1's rollout
    log-probs are the adapter policy's (the ranks' old log-probs), not the base model's."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "adapter")
    train = write_rows(make_rows(4), str(tmp_path / "t.jsonl"))
    run(
        small_config(
            f"data.train_files=[{train}]",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
            f"trainer.ray_address={ray.get_runtime_context().gcs_address}",
        )
    )
    records = read_rollout_dump(tmp_path / "rollouts" / "step_000001.parquet")[1]
    gaps = [
        abs(old - sampled)
        for record in records
        for old, sampled, mask in zip(record["old_log_probs"], record["rollout_log_probs"], record["response_mask"])
        if mask
    ]
    assert gaps and max(gaps) < 1e-3, f"the first rollout was not the adapter's policy (largest gap {max(gaps):.3g})"
