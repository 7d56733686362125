"""``JudgeSettings``: the judge's (``reward_model.*``) own settings, read once from its section.

Its servers are ``ServerSettings`` of their own, built here from ``reward_model.rollout`` and, for what that section
does not set, the policy's server settings, which they start from: the engine (``reward_model.rollout.name``, null:
the policy's), its tuning (``hf``/``sglang``/``vllm``), supervision and budgets. A judge's servers always launch
(never attach to the policy's URLs), on ports past the policy servers', and have no HTTP fronts of their own (the
workers reach them through their routers, ``agentloop.judge.front``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentloop.settings.reading import Section
from agentloop.settings.server import ServerSettings, ray_resources

KINDS = ("generative", "discriminative")


def resolve_kind(kind: str, model_path: str) -> str:
    """``reward_model.kind``, with ``auto`` read from the checkpoint: discriminative for a sequence-classification
    architecture (verl's reward models), else generative."""
    if kind != "auto":
        return kind
    manifest = Path(model_path) / "config.json"
    architectures = json.loads(manifest.read_text()).get("architectures") or [] if manifest.is_file() else []
    return (
        "discriminative" if any(name.endswith("ForSequenceClassification") for name in architectures) else "generative"
    )


@dataclass(frozen=True)
class JudgeSettings:
    """A frozen model served beside the policy: ``kind`` (``auto`` resolved), its sampling, its call bound
    (``timeout_s``), whether it sleeps with the policy's servers, and its servers' settings."""

    kind: str
    model_path: str
    timeout_s: float
    sampling: dict[str, Any]
    free_cache_engine: bool
    servers: ServerSettings

    @classmethod
    def from_section(cls, reward_model: Section, policy: ServerSettings) -> JudgeSettings | None:
        """The judge of ``reward_model`` (the ``reward_model`` section), None when ``enable`` is off."""
        if not reward_model.bool("enable"):
            return None
        model_path = reward_model.sub("model").optional_str("path")
        kind = resolve_kind(reward_model.str("kind", (*KINDS, "auto")), model_path or policy.model_path)
        if kind == "discriminative" and not model_path:
            raise reward_model.sub("model").error(
                "path",
                "reward_model.kind=discriminative needs a model of its own",
                "set it to a sequence-classification checkpoint",
            )
        rollout = reward_model.sub("rollout")
        return cls(
            kind=kind,
            model_path=model_path or policy.model_path,
            timeout_s=reward_model.float("timeout_s", positive=True),
            sampling={
                "max_new_tokens": rollout.int("response_length", minimum=1),
                "temperature": rollout.float("temperature", minimum=0.0),
                "top_p": rollout.float("top_p", positive=True),
                "top_k": rollout.int("top_k"),
            },
            free_cache_engine=rollout.bool("free_cache_engine"),
            servers=_servers(rollout, model_path or policy.model_path, policy),
        )


def _servers(rollout: Section, model_path: str, policy: ServerSettings) -> ServerSettings:
    """The judge's servers: the policy's settings with ``reward_model.rollout``'s in their places."""
    sglang = dataclasses.replace(policy.sglang, urls=())
    if policy.sglang.port:
        sglang = dataclasses.replace(sglang, port=policy.sglang.port + policy.data_parallel_size)
    vllm = dataclasses.replace(policy.vllm, urls=())
    if policy.vllm.port:
        vllm = dataclasses.replace(vllm, port=policy.vllm.port + policy.data_parallel_size)
    return dataclasses.replace(
        policy,
        model_path=model_path,
        section=rollout.key,
        role="judge server",
        name=rollout.optional_str("name") or policy.name,
        data_parallel_size=rollout.int("data_parallel_size", minimum=1),
        resources=ray_resources(rollout),
        prompt_length=rollout.int("prompt_length", minimum=1),
        response_length=rollout.int("response_length", minimum=1),
        max_model_len=None,
        sglang=sglang,
        vllm=vllm,
        http=dataclasses.replace(policy.http, enable=False),
        lora_rank=0,  # a judge is never pushed weights
        lora_target_modules=(),
    )
