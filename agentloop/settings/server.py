"""``ServerSettings``: what a rollout server, its engine and its supervising pool need, typed and checked once.

The policy's come from ``actor_rollout_ref.rollout`` (``ServerSettings.from_section``); a judge's are its own
(``agentloop.settings.judge``). ``section`` is where the keys were read, so every message names the key to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop.settings.adapters import named_adapters
from agentloop.settings.reading import Section

ENGINE_NAMES = ("hf", "sglang", "vllm")  # or a dotted class path (agentloop.server.engine.ENGINES)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
HF_ATTENTION = ("auto", "sdpa")
WEIGHT_SYNC_PATHS = ("object_store", "collective", "disk")


@dataclass(frozen=True)
class SupervisionSettings:
    """``rollout.supervision``: when a server counts as dead, and how often it is replaced before it is given up."""

    health_timeout_s: float = 60.0
    max_restarts: int = 3
    window_s: float = 600.0

    @classmethod
    def from_section(cls, section: Section) -> SupervisionSettings:
        return cls(
            section.float("health_timeout_s", positive=True),
            section.int("max_restarts", minimum=0),
            section.float("window_s", positive=True),
        )


@dataclass(frozen=True)
class WeightSyncSettings:
    """``rollout.weight_sync*``: how a weight push reaches the servers. ``object_store``: trainer rank 0's packed
    state dict through Ray's object store; ``collective``: bucketed broadcasts over a ``torch.distributed`` group of
    rank 0 and every server, made for the push (its store at ``master_addr:master_port``, every wait bounded by
    ``timeout_s``); ``disk``: a Hugging Face checkpoint written under ``dir`` that every server loads."""

    path: str = "object_store"
    bucket_megabytes: float = 64.0
    master_addr: str | None = None
    master_port: int = 0
    timeout_s: float = 60.0
    dir: str = "/dev/shm"

    @classmethod
    def from_section(cls, rollout: Section) -> WeightSyncSettings:
        return cls(
            rollout.str("weight_sync", WEIGHT_SYNC_PATHS, default="object_store"),
            rollout.sub("checkpoint_engine").float("update_weights_bucket_megabytes", positive=True, default=64.0),
            rollout.optional_str("weight_sync_master_addr"),
            rollout.int("weight_sync_master_port", minimum=0, default=0),
            rollout.float("weight_sync_timeout_s", positive=True, default=60.0),
            rollout.str("weight_sync_dir", default="/dev/shm"),
        )

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_megabytes * 2**20))


@dataclass(frozen=True)
class HTTPSettings:
    """``rollout.http``: every server's HTTP front (off for a judge's servers)."""

    enable: bool = True
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_body_bytes: int = 33554432

    @classmethod
    def from_section(cls, section: Section) -> HTTPSettings:
        return cls(
            section.bool("enable"),
            section.str("host"),
            section.int("port", minimum=0),
            section.optional_str("api_key"),
            section.int("max_body_bytes", minimum=1),
        )


@dataclass(frozen=True)
class HFSettings:
    """``rollout.hf``: the hf engine's device and paged KV cache."""

    device: str = "auto"
    page_size: int = 16
    num_blocks: int = 1024
    max_batch_tokens: int = 2048
    attention: str = "auto"

    @classmethod
    def from_section(cls, section: Section) -> HFSettings:
        return cls(
            section.str("device"),
            section.int("page_size", minimum=1),
            section.int("num_blocks", minimum=1),
            section.int("max_batch_tokens", minimum=1),
            section.str("attention", HF_ATTENTION),
        )


@dataclass(frozen=True)
class SGLangSettings:
    """``rollout.sglang``: a launched SGLang server per rank (port + rank), or attached ones (``urls``)."""

    urls: tuple[str, ...] = ()
    api_key: str | None = None
    port: int = 30000
    tensor_parallel_size: int = 1
    mem_fraction_static: float = 0.6
    enable_memory_saver: bool = True
    weights_dir: str | None = "/dev/shm"
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_section(cls, section: Section) -> SGLangSettings:
        return cls(
            section.strings("urls"),
            section.optional_str("api_key"),
            section.int("port", minimum=0),
            section.int("tensor_parallel_size", minimum=1),
            section.float("mem_fraction_static", positive=True),
            section.bool("enable_memory_saver"),
            section.optional_str("weights_dir"),
            section.strings("extra_args"),
        )


@dataclass(frozen=True)
class VLLMSettings:
    """``rollout.vllm``: a launched vLLM server per rank (port + rank, 0: any free port), or attached ones."""

    python: str | None = None
    urls: tuple[str, ...] = ()
    api_key: str | None = None
    port: int = 0
    weights_dir: str | None = "/dev/shm"
    cpu_kvcache_space_gb: float = 1.0
    cpu_threads_bind: str = "nobind"
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_section(cls, section: Section) -> VLLMSettings:
        return cls(
            section.optional_str("python"),
            section.strings("urls"),
            section.optional_str("api_key"),
            section.int("port", minimum=0),
            section.optional_str("weights_dir"),
            section.float("cpu_kvcache_space_gb", positive=True),
            section.str("cpu_threads_bind"),
            section.strings("extra_args"),
        )


@dataclass(frozen=True)
class ServerSettings:
    """One pool of servers: which engine on which model, their resources, budgets and supervision.

    ``role`` is what messages call the servers (``rollout server``, ``judge server``); ``section`` the config key
    their settings were read from. ``lora_rank``: the largest rank of the LoRA adapters pushed to them (0: full-weight
    pushes; the policy's, see ``lora_rank``), ``lora_target_modules`` the modules they adapt (``lora_target_modules``). ``vllm_flags`` holds verl's ``rollout.*`` keys that have a vLLM meaning (null:
    vLLM's default); ``engine_kwargs`` the extra launch flags per backend.
    """

    model_path: str
    section: str = "actor_rollout_ref.rollout"
    role: str = "rollout server"
    name: str = "hf"
    dtype: str = "float32"
    seed: int = 0
    data_parallel_size: int = 1
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement_strategy: str = "PACK"
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    supervision: SupervisionSettings = SupervisionSettings()
    weight_sync: WeightSyncSettings = WeightSyncSettings()
    prompt_length: int = 512
    response_length: int = 256
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.6
    vllm_flags: dict[str, Any] = field(default_factory=dict)
    engine_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    hf: HFSettings = HFSettings()
    sglang: SGLangSettings = SGLangSettings()
    vllm: VLLMSettings = VLLMSettings()
    http: HTTPSettings = HTTPSettings()
    tool_format: str = "hermes"
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    lora_adapters: int = 1  # how many adapters they serve side by side (``actor_rollout_ref.model.lora_adapters``)

    @classmethod
    def from_section(cls, rollout: Section, model_path: str) -> ServerSettings:
        """The policy's servers: ``rollout`` is ``actor_rollout_ref.rollout``, ``model_path`` the policy's model."""
        name = rollout.str("name")
        if name not in ENGINE_NAMES and "." not in name:
            raise rollout.error(
                "name",
                "is not a known backend",
                f"choose one of {list(ENGINE_NAMES)} or a dotted path to a class implementing "
                "agentloop.server.engine.Engine",
            )
        if name == "hf" and rollout.int("tensor_model_parallel_size") != 1:
            raise rollout.error(
                "tensor_model_parallel_size",
                "the hf engine has no tensor parallelism",
                "set it to 1, or rollout.name=vllm or sglang",
            )
        return cls(
            model_path=model_path,
            section=rollout.key,
            name=name,
            dtype=rollout.str("dtype"),
            seed=rollout.int("seed"),
            data_parallel_size=rollout.int("data_parallel_size", minimum=1),
            resources=ray_resources(rollout),
            placement_strategy=rollout.str("placement_strategy", PLACEMENT_STRATEGIES),
            startup_timeout_s=rollout.float("server_startup_timeout_s", positive=True),
            request_timeout_s=rollout.float("request_timeout_s", positive=True),
            supervision=SupervisionSettings.from_section(rollout.sub("supervision")),
            weight_sync=WeightSyncSettings.from_section(rollout),
            prompt_length=rollout.int("prompt_length", minimum=1),
            response_length=rollout.int("response_length", minimum=1),
            max_model_len=rollout.optional_int("max_model_len", minimum=1),
            gpu_memory_utilization=rollout.float("gpu_memory_utilization", positive=True),
            vllm_flags=_vllm_flags(rollout),
            engine_kwargs={backend: rollout.sub("engine_kwargs").mapping(backend) for backend in ("sglang", "vllm")},
            hf=HFSettings.from_section(rollout.sub("hf")),
            sglang=SGLangSettings.from_section(rollout.sub("sglang")),
            vllm=VLLMSettings.from_section(rollout.sub("vllm")),
            http=HTTPSettings.from_section(rollout.sub("http")),
            tool_format=rollout.sub("multi_turn").str("format"),
        )

    @property
    def cpus(self) -> int:
        """CPU threads a server's process uses (its ``resources_per_server.CPU``, at least 1)."""
        return max(1, int(self.resources.get("CPU", 1)))

    @property
    def context_length(self) -> int:
        """The longest context a turn may be sampled under: ``max_model_len``, else prompt + response length."""
        return self.max_model_len or self.prompt_length + self.response_length

    def attached_url(self, backend: str, rank: int) -> str | None:
        """``<backend>.urls[rank]``: the running server this rank attaches to, or None to launch one."""
        urls = getattr(self, backend).urls
        if urls and len(urls) < self.data_parallel_size:
            raise ValueError(
                f"{self.section}.{backend}.urls lists {len(urls)} server(s) for "
                f"data_parallel_size={self.data_parallel_size}; list one URL per server"
            )
        return urls[rank] if urls else None


def _adapter_configs(model: Section) -> list[dict[str, Any]]:
    """Each policy adapter's PEFT config as a server sees it: ``r`` (largest of ``rank_pattern`` too) and
    ``target_modules``; a saved adapter's (``lora_adapter_path``, a ``lora_adapters`` entry's ``path``) from its
    ``adapter_config.json``. Empty without LoRA."""
    specs = named_adapters(model)
    if specs:
        return [
            _saved_config(spec.path) if spec.path else {"r": spec.rank, "target_modules": spec.target_modules}
            for spec in specs
        ]
    path = model.optional_str("lora_adapter_path")
    if path is not None and (Path(path) / "adapter_config.json").is_file():
        return [_saved_config(path)]
    rank = model.int("lora_rank", minimum=0, default=0)
    return [{"r": rank, "target_modules": model.raw("target_modules")}] if rank else []


def _saved_config(path: str) -> dict[str, Any]:
    config = json.loads((Path(path) / "adapter_config.json").read_text())
    ranks = [int(config.get("r") or 0), *(int(rank) for rank in (config.get("rank_pattern") or {}).values())]
    return {"r": max(ranks), "target_modules": config.get("target_modules")}


def lora_target_modules(model: Section) -> tuple[str, ...]:
    """The module names the policy's LoRA adapters adapt, as servers that preallocate adapter buffers (SGLang) take
    them: a saved adapter's own, else ``target_modules``; ``("all",)`` for a pattern (``all-linear`` or a regex),
    which only the model resolves."""
    names: set[str] = set()
    for config in _adapter_configs(model):
        targets = config.get("target_modules")
        if targets is None or isinstance(targets, str):
            return ("all",)
        names |= {str(name).split(".")[-1] for name in targets}
    return tuple(sorted(names)) if names else ("all",)


def lora_rank(model: Section) -> int:
    """The largest rank of the LoRA adapters the policy's servers will be pushed (``model`` is
    ``actor_rollout_ref.model``): a saved adapter's own, else ``lora_rank`` (or an entry's ``rank``); 0: no LoRA."""
    return max([int(config["r"]) for config in _adapter_configs(model)], default=0)


def ray_resources(section: Section, key: str = "resources_per_server") -> dict[str, float]:
    """``section.key``, Ray resources by name (``CPU``, ``GPU`` or a custom resource a node was started with), as a
    Ray bundle (zero entries left out)."""
    resources = section.mapping(key)
    try:
        return {str(name): float(value) for name, value in resources.items() if value}
    except (TypeError, ValueError):
        raise section.error(key, "holds a value that is not a number", "write it as {CPU: 1, GPU: 0}") from None


def _vllm_flags(rollout: Section) -> dict[str, Any]:
    """verl's ``rollout.*`` keys with a vLLM meaning, by vLLM's flag name (null: vLLM's default)."""
    return {
        "tensor_parallel_size": rollout.int("tensor_model_parallel_size", minimum=1),
        **{
            key: rollout.raw(key)
            for key in (
                "max_num_batched_tokens",
                "max_num_seqs",
                "enable_chunked_prefill",
                "enable_prefix_caching",
                "enforce_eager",
            )
        },
    }
