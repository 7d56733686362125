"""Typed settings per section (agentloop.settings): each is read once from the composed config, refuses a bad value
naming its key and the fix, pickles (it crosses Ray process boundaries), and the judge's servers have settings of
their own."""

from __future__ import annotations

import pickle

import pytest

from agentloop.settings import JudgeSettings, RolloutSettings, Section, judge_settings, rollout_settings
from tests.support.config import small_config

ROLLOUT = "actor_rollout_ref.rollout"


@pytest.mark.parametrize(
    "override, message",
    [
        ("n=0", r"actor_rollout_ref.rollout.n=0: must be at least 1; set it to 1 or more"),
        ("val_kwargs.n=0", r"actor_rollout_ref.rollout.val_kwargs.n=0: must be at least 1"),
        ("n=two", r"actor_rollout_ref.rollout.n='two': is not an integer; set it to an integer"),
        ("n=1.5", r"actor_rollout_ref.rollout.n=1.5: is not an integer"),
        ("temperature=-1", r"actor_rollout_ref.rollout.temperature=-1: must be at least 0"),
        ("mode=sync", r"actor_rollout_ref.rollout.mode='sync': .*; set it to async"),
        ("max_failed_sample_ratio=2", r"max_failed_sample_ratio=2: is a share of the batch; set it between 0 and 1"),
        ("generate_timeout_s=0", r"actor_rollout_ref.rollout.generate_timeout_s=0: must be above 0"),
        ("agent.num_workers=-1", r"actor_rollout_ref.rollout.agent.num_workers=-1: .*set it >= 1, or 0"),
        ("supervision.max_restarts=-1", r"actor_rollout_ref.rollout.supervision.max_restarts=-1: must be at least 0"),
        ("supervision.health_timeout_s=0", r"supervision.health_timeout_s=0: must be above 0"),
        ("data_parallel_size=0", r"actor_rollout_ref.rollout.data_parallel_size=0: must be at least 1"),
        ("placement_strategy=pack", r"placement_strategy='pack': is not a known choice; choose one of \['PACK'"),
        (
            "weight_sync=nccl",
            r"weight_sync='nccl': is not a known choice; choose one of \['object_store', 'collective'",
        ),
        ("weight_sync_timeout_s=0", r"actor_rollout_ref.rollout.weight_sync_timeout_s=0: must be above 0"),
        ("name=trtllm", r"actor_rollout_ref.rollout.name='trtllm': is not a known backend; choose one of"),
        ("hf.attention=flash", r"actor_rollout_ref.rollout.hf.attention='flash': .*choose one of \['auto', 'sdpa'\]"),
        ("hf.num_blocks=0", r"actor_rollout_ref.rollout.hf.num_blocks=0: must be at least 1"),
        ("http.enable=maybe", r"actor_rollout_ref.rollout.http.enable='maybe': is not true or false"),
        ("sglang.extra_args=--x", r"actor_rollout_ref.rollout.sglang.extra_args='--x': is not a list"),
        ("vllm.port=-1", r"actor_rollout_ref.rollout.vllm.port=-1: must be at least 0"),
        ("resources_per_server.CPU=many", r"resources_per_server=.*: holds a value that is not a number"),
        ("multi_turn.format=null", r"actor_rollout_ref.rollout.multi_turn.format=None: is empty"),
    ],
)
def test_rollout_settings_refuse_a_bad_value_naming_the_key_and_the_fix(override, message):
    with pytest.raises(ValueError, match=message):
        rollout_settings(small_config(f"{ROLLOUT}.{override}"))


def test_rollout_settings_are_typed_once_and_pickle():
    settings = rollout_settings(small_config(f"{ROLLOUT}.n=3", f"{ROLLOUT}.vllm.extra_args=[--a,'1']"))
    assert (settings.n, settings.servers.response_length, settings.servers.context_length) == (3, 24, 96 + 24)
    assert settings.servers.vllm.extra_args == ("--a", "1") and settings.servers.cpus == 1
    assert pickle.loads(pickle.dumps(settings)) == settings
    assert isinstance(settings, RolloutSettings) and settings.servers.section == ROLLOUT


def test_attached_urls_must_cover_every_server():
    settings = rollout_settings(
        small_config(f"{ROLLOUT}.data_parallel_size=2", f"{ROLLOUT}.sglang.urls=[http://a:1]")
    ).servers
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref.rollout.sglang.urls lists 1 server\(s\) for data_parallel"
    ):
        settings.attached_url("sglang", 0)


def judge_of(*overrides: str) -> JudgeSettings | None:
    config = small_config(*overrides)
    return judge_settings(config, rollout_settings(config).servers)


def test_the_judge_has_settings_of_its_own():
    assert judge_of() is None, "reward_model.enable=false: no judge"
    judge = judge_of(
        "reward_model.enable=true",
        "reward_model.rollout.response_length=8",
        "reward_model.rollout.data_parallel_size=2",
        f"{ROLLOUT}.data_parallel_size=3",
        f"{ROLLOUT}.sglang.urls=[http://a:1,http://b:2,http://c:3]",
        f"{ROLLOUT}.vllm.port=9000",
    )
    policy = rollout_settings(small_config()).servers
    assert judge.kind == "generative" and judge.model_path == policy.model_path
    assert judge.sampling == {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    servers = judge.servers
    assert (servers.role, servers.section, servers.name) == ("judge server", "reward_model.rollout", "hf")
    assert servers.data_parallel_size == 2 and servers.response_length == 8 and servers.max_model_len is None
    assert servers.sglang.urls == () and servers.vllm.port == 9003, "launched on ports past the policy servers'"
    assert servers.http.enable is False
    assert pickle.loads(pickle.dumps(judge)) == judge


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward_model.kind=judge"], r"reward_model.kind='judge': is not a known choice; choose one of"),
        (["reward_model.kind=discriminative"], r"reward_model.model.path=None: .*needs a model of its own; set it to"),
        (["reward_model.timeout_s=0"], r"reward_model.timeout_s=0: must be above 0"),
        (["reward_model.rollout.data_parallel_size=0"], r"reward_model.rollout.data_parallel_size=0: must be at least"),
        (["reward_model.rollout.free_cache_engine=1"], r"reward_model.rollout.free_cache_engine=1: is not true or"),
    ],
)
def test_judge_settings_refuse_a_bad_value_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        judge_of("reward_model.enable=true", *overrides)


def test_a_section_reader_names_the_full_key():
    section = Section({"inner": {"size": "x"}}, "outer")
    with pytest.raises(ValueError, match=r"^outer.inner.size='x': is not an integer; set it to an integer$"):
        section.sub("inner").int("size")
    assert Section(None, "absent").optional_int("size") is None
