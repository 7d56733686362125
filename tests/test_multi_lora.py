"""Several LoRA adapters on one base (``actor_rollout_ref.model.lora_adapters``) through the real stack: one vLLM
server serving each adapter under its name, each sample generated with its agent entry's adapter, two FSDP ranks
training each adapter on its own samples only (against an unsharded ``peft`` step on those samples), a frozen judge
adapter that never changes, checkpoints with a PEFT folder per adapter, and the configuration errors."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from agentloop.preflight import check_job
from agentloop.rows import write_rows
from agentloop.tasks.arithmetic.data import make_rows
from agentloop.server.adapters import PackedAdapter
from agentloop.server.sglang_engine import ADAPTER_NAME, launch_args
from agentloop.server.sglang_requests import build_generate_request
from agentloop.settings import rollout_settings
from tests.support.config import small_config
from tests.support.ranks import manager_and_two_ranks
from tests.support.sglang_contract import load_api_types, parse_lora_flags
from tests.test_lora import KL_COEF, LR, halves, local_step, random_adapter, unsharded
from trainer.config_checks import check_config
from trainer.fsdp_workers import push_weights
from trainer.lora import LoraSettings, adapter_indices
from trainer.main_ppo import run

SINGLE_TURN = "agentloop.agent_loop.single_turn.SingleTurnAgentLoop"
api_types = load_api_types()
ROLES = {"solver_agent": "solver", "checker_agent": "checker", "judge_agent": "judge"}


def rows(*agents: str) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"question number {i}"}], "agent_name": agent}
        for i, agent in enumerate(agents)
    ]


def agent_file(tmp_path, roles: dict[str, str]) -> str:
    entries = [{"name": name, "_target_": SINGLE_TURN, "lora_adapter": adapter} for name, adapter in roles.items()]
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(entries))
    return str(path)


def adapters_override(judge_path: str) -> str:
    return (
        "actor_rollout_ref.model.lora_adapters="
        f"[{{name:solver}},{{name:checker}},{{name:judge,path:'{judge_path}',trainable:false}}]"
    )


def test_a_training_run_trains_each_agents_adapter_and_checkpoints_them(local_ray, model_path, tmp_path):
    """The trainer's own loop: the adapters pushed before the first rollout, each row's adapter read from the batch,
    the agent's adapter trained and the other left as it was, a PEFT folder per adapter in the checkpoint."""
    from tests.test_vllm_engine import vllm_overrides

    # half the rows name the frozen judge adapter themselves; the others take their loop's, the checker
    data = [{**row, "lora_adapter": "judge" if index % 2 else None} for index, row in enumerate(make_rows(4))]
    train = write_rows(data, str(tmp_path / "train.jsonl"))
    judge, _ = random_adapter(model_path, 6)
    judge.save(tmp_path / "judge")
    judge_entry = f"{{name:judge,path:'{tmp_path / 'judge'}',trainable:false}}"  # (frozen: its rows scored apart)
    # the arithmetic rows' loop, here single-turn, its samples on the second adapter
    roles = {"tool_agent": "checker"}
    history = run(
        small_config(
            *vllm_overrides(),
            "actor_rollout_ref.model.lora_rank=4",
            f"actor_rollout_ref.model.lora_adapters=[{{name:solver}},{{name:checker}},{judge_entry}]",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_file(tmp_path, roles)}",
            f"data.train_files=[{train}]",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            # the tiny model's rewards are all alike (no advantage): the entropy bonus makes a gradient regardless
            "actor_rollout_ref.actor.entropy_coeff=0.1",
            "trainer.total_training_steps=1",
            "trainer.save_freq=1",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        )
    )
    assert history[-1]["actor/grad_norm/checker"] > 0 and history[-1]["actor/grad_norm/solver"] == 0
    # every row re-scored under its own adapter (the judge's too) as vLLM sampled it
    assert history[-1]["rollout_corr/abs_log_prob_diff"] < 1e-3
    saved = tmp_path / "run" / "global_step_1" / "actor" / "lora_adapter"
    factors = {name: PackedAdapter.load(saved / name).weights.tensors() for name in ("solver", "checker")}
    assert equal(PackedAdapter.load(saved / "judge"), judge)
    ups = {name: [value for key, value in tensors.items() if "lora_B" in key] for name, tensors in factors.items()}
    assert all(not value.any() for value in ups["solver"])  # as it was made: lora_B at zero
    assert any(value.any() for value in ups["checker"])


@pytest.fixture(scope="module")
def setup(local_ray, model_path, tmp_path_factory):
    from tests.test_vllm_engine import vllm_overrides

    directory = tmp_path_factory.mktemp("multi_lora")
    judge, judge_model = random_adapter(model_path, 5)
    judge.save(directory / "judge")
    config = small_config(
        *vllm_overrides(),
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        adapters_override(str(directory / "judge")),
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_file(directory, ROLES)}",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.kl_loss_coef={KL_COEF}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    )
    for manager, actors in manager_and_two_ranks(config):
        push_weights(actors, manager, 120, version=0)  # (the trainer's first push, before its first rollout)
        yield manager, actors, judge, judge_model


def adapters_of(actors) -> dict[str, PackedAdapter]:
    """The ranks' adapters as the push sends them (a collective; rank 0 returns them)."""
    adapters, other = ray.get([actor.packed_state_dict.remote() for actor in actors], timeout=120)
    assert isinstance(adapters, dict) and other is None
    return adapters


def generated(manager, *agents: str):
    """A batch of the agents' samples (two per row), with the ``adapter_index`` the trainer gives it."""
    rollout = manager.generate_sequences(rows(*agents))
    batch = rollout.batch.clone()
    names = rollout.non_tensor_batch["lora_adapter"]
    assert list(names) == [ROLES[agent] for agent in agents for _ in range(2)]
    batch["adapter_index"] = adapter_indices(LoraSettings.from_config(manager.config), names, len(batch))
    return batch


def scored(actors, batch) -> torch.Tensor:
    return torch.cat(
        ray.get([actor.compute_log_prob.remote(half) for actor, half in zip(actors, halves(batch))], timeout=120)
    )


def train_step(actors, batch) -> tuple[list[dict], torch.Tensor]:
    train = batch.clone()
    train["old_log_probs"] = scored(actors, batch)
    train["ref_log_probs"] = train["old_log_probs"].clone()
    train["advantages"] = torch.where(torch.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * train["response_mask"]
    metrics = ray.get([actor.update_policy.remote(half) for actor, half in zip(actors, halves(train))], timeout=120)
    return metrics, train


def equal(first: PackedAdapter, second: PackedAdapter) -> bool:
    theirs = second.weights.tensors()
    return all(torch.equal(value, theirs[name]) for name, value in first.weights.tensors().items())


def test_each_adapter_trains_on_its_own_samples_only(setup):
    manager, actors, judge, _ = setup
    before = adapters_of(actors)
    assert list(before) == ["solver", "checker", "judge"] and equal(before["judge"], judge)
    # solver's samples only: the checker had none this step, and the judge is frozen
    metrics, train = train_step(actors, generated(manager, "solver_agent", "solver_agent"))
    after = adapters_of(actors)
    assert not equal(before["solver"], after["solver"])
    assert equal(before["checker"], after["checker"]) and equal(before["judge"], after["judge"])
    model = unsharded(manager, before["solver"])
    norm = local_step(model, train, manager.config, adapter_index=0)[1]
    assert metrics[0]["actor/grad_norm/solver"] == pytest.approx(norm, rel=1e-4)
    assert metrics[0]["actor/grad_norm/checker"] == 0.0
    trained = unsharded(manager, after["solver"])
    expected = dict(model.named_parameters())
    moved = [name for name, value in trained.named_parameters() if value.requires_grad]
    assert moved and all(torch.allclose(trained.get_parameter(n), expected[n], atol=1e-6) for n in moved)

    # a mixed batch: each trainable adapter's step is the unsharded step on its own samples; the judge's samples
    # are scored under the judge (as vLLM sampled them) and train nothing
    before = after
    batch = generated(manager, "checker_agent", "judge_agent", "solver_agent", "checker_agent")
    metrics, train = train_step(actors, batch)
    after = adapters_of(actors)
    assert equal(before["judge"], after["judge"])
    for index, name in enumerate(["solver", "checker"]):
        model = unsharded(manager, before[name])
        norm = local_step(model, train, manager.config, adapter_index=index)[1]
        assert metrics[0][f"actor/grad_norm/{name}"] == pytest.approx(norm, rel=1e-4)
    # the checker's first step (the solver's second starts from Adam's moments of its first): the reference's too
    trained, expected = unsharded(manager, after["checker"]), dict(model.named_parameters())
    moved = [key for key, value in trained.named_parameters() if value.requires_grad]
    assert all(torch.allclose(trained.get_parameter(key), expected[key], atol=1e-6) for key in moved)
    assert not equal(before["checker"], after["checker"]) and not equal(before["solver"], after["solver"])


def test_after_a_push_vllm_serves_each_adapter_under_its_name(setup):
    manager, actors, judge, judge_model = setup
    adapters = adapters_of(actors)
    push_weights(actors, manager, 120, version=3)
    server = manager.pool.servers[0]
    prompt = [5, 17, 99, 3, 40, 41]
    params = {"temperature": 0.0, "max_new_tokens": 12}
    merged = {name: unsharded(manager, adapter).merge_and_unload().eval() for name, adapter in adapters.items()}
    merged["judge"] = judge_model

    def expected(model) -> list[int]:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        return tokens[0, len(prompt) :].tolist()

    served = {
        name: ray.get(server.generate.remote(prompt, params, str(uuid.uuid4()), None, name), timeout=120).token_ids
        for name in adapters
    }
    assert served == {name: expected(model) for name, model in merged.items()}
    assert len({tuple(tokens) for tokens in served.values()}) > 1  # (the adapters differ, or this proves little)
    # sampled turns are scored by the ranks under each row's adapter as vLLM sampled them
    batch = generated(manager, "judge_agent", "solver_agent", "checker_agent", "judge_agent")
    mask = batch["response_mask"].bool()
    assert torch.allclose(scored(actors, batch)[mask], batch["rollout_log_probs"][mask], atol=1e-4)
    with pytest.raises(Exception, match="the LoRA adapter 'nobody' was not pushed to this server"):
        ray.get(server.generate.remote(prompt, params, str(uuid.uuid4()), None, "nobody"), timeout=120)


def test_checkpoint_saves_a_peft_folder_per_adapter_and_resume_restores_them(setup, tmp_path):
    manager, actors, _, _ = setup
    hf = tmp_path / "actor" / "huggingface"
    ray.get([actor.save_checkpoint.remote(str(tmp_path / "workers"), str(hf)) for actor in actors], timeout=120)
    saved = adapters_of(actors)
    base = AutoModelForCausalLM.from_pretrained(manager.config.actor_rollout_ref.model.path)
    loaded = PeftModel.from_pretrained(base, tmp_path / "actor" / "lora_adapter" / "solver", adapter_name="solver")
    for name in ("checker", "judge"):
        loaded.load_adapter(tmp_path / "actor" / "lora_adapter" / name, adapter_name=name)
    state = {key: value for key, value in loaded.state_dict().items() if ".lora_" in key}
    for name, adapter in saved.items():
        for key, value in adapter.weights.tensors().items():
            assert torch.equal(state[key.replace(".weight", f".{name}.weight")], value)
    train_step(actors, generated(manager, "solver_agent", "checker_agent"))
    assert not equal(adapters_of(actors)["checker"], saved["checker"])
    ray.get([actor.load_checkpoint.remote(str(tmp_path / "workers")) for actor in actors], timeout=120)
    restored = adapters_of(actors)
    assert all(equal(saved[name], restored[name]) for name in saved)


def test_bad_multi_adapter_settings_fail_before_any_server_starts_naming_the_key(model_path, tmp_path):
    train = tmp_path / "t.jsonl"
    train.write_text("")
    base = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.rollout.name=vllm"]
    with pytest.raises(ValueError, match=r"model.lora_adapters=.*names \['a'\] more than once"):
        check_config(small_config(*base, "actor_rollout_ref.model.lora_adapters=[{name:a},{name:a}]"))
    with pytest.raises(ValueError, match=r"lora_adapters\[1\].rnk=2: is not an adapter field"):
        check_config(small_config(*base, "actor_rollout_ref.model.lora_adapters=[{name:a},{name:b,rnk:2}]"))
    with pytest.raises(ValueError, match=r"model.lora_adapters=.*has no trainable adapter"):
        check_config(small_config(*base, "actor_rollout_ref.model.lora_adapters=[{name:a,trainable:false}]"))
    with pytest.raises(
        ValueError,
        match=r"lora_adapters is set, and .*rollout.name=hf serves one adapter at a time.*\['vllm', 'sglang'\]",
    ):
        check_config(
            small_config("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_adapters=[{name:a}]")
        )
    roles = {"solver_agent": "solver", "stranger_agent": "stranger"}
    config = small_config(
        *base,
        "actor_rollout_ref.model.lora_adapters=[{name:solver},{name:checker}]",
        f"data.train_files=[{train}]",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_file(tmp_path, roles)}",
    )
    check_config(config)
    with pytest.raises(ValueError, match=r"'stranger_agent' has lora_adapter='stranger', which is not among .*"):
        check_job(config, {"train": rows("solver_agent")})
    with pytest.raises(ValueError, match=r"rows have lora_adapter \['nobody'\], not among"):
        check_job(config, {"train": [{**rows("solver_agent")[0], "lora_adapter": "nobody"}]})
    settings = LoraSettings.from_config(config)
    assert [spec.name for spec in settings.adapters] == ["solver", "checker"] and settings.adapters[1].rank == 4
    settings.check_model(model_path)


@pytest.mark.skipif(api_types is None, reason="sglang (installed with --no-deps) and msgspec are needed")
def test_sglang_is_launched_for_every_adapter_and_requests_name_theirs_as_the_wheel_expects():
    adapters = "[{name:solver,target_modules:[q_proj]},{name:checker,rank:8,target_modules:[v_proj]},{name:judge}]"
    settings = rollout_settings(
        small_config(
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.model.target_modules=[k_proj]",
            f"actor_rollout_ref.model.lora_adapters={adapters}",
        )
    ).servers
    flags = launch_args(settings, rank=0)
    parsed = parse_lora_flags(flags[flags.index("--enable-lora") : flags.index("--max-loras-per-batch") + 2])
    # the largest rank, every adapter's modules, and a batch that mixes the three adapters with the base model
    assert parsed["max_lora_rank"] == 8 and parsed["lora_target_modules"] == ["k_proj", "q_proj", "v_proj"]
    assert parsed["max_loras_per_batch"] == 4
    request = build_generate_request([1, 2, 3], {}, "rid-1", lora_name=f"{ADAPTER_NAME}-checker")
    assert api_types.GenerateRequest.from_json_value(request).lora_path == f"{ADAPTER_NAME}-checker"
