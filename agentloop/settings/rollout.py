"""``RolloutSettings``: ``actor_rollout_ref.rollout`` as the manager, its worker pool and workers read it, typed and
checked once (the servers' part is ``ServerSettings``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop.settings.reading import Section
from agentloop.settings.reward import RewardSettings
from agentloop.settings.server import ServerSettings, ray_resources

ROLLOUT_KEY = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class GatewaySettings:
    """``rollout.agent.gateway``: where a worker's session gateway serves (port 0: any free one), and the largest
    request body it takes (larger ones get 413)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = 8388608

    @classmethod
    def from_section(cls, gateway: Section) -> GatewaySettings:
        return cls(gateway.str("host"), gateway.int("port", minimum=0), gateway.int("max_body_bytes", minimum=1))


@dataclass(frozen=True)
class AgentSettings:
    """``rollout.agent``: the agent-loop workers (how many, and the Ray resources each asks for, which place them on
    the nodes that offer those), which loop a row without ``agent_name`` runs, and the workers' session gateways
    (``external_agent``)."""

    num_workers: int = 2
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: str | None = None
    group_affinity_slack: int | None = 8
    resources: dict[str, float] = field(default_factory=dict)
    gateway: GatewaySettings = GatewaySettings()

    @classmethod
    def from_section(cls, agent: Section, multi_turn: bool) -> AgentSettings:
        """verl's ``multi_turn.enable`` turns the single-turn default into ``tool_agent``."""
        if agent.int("num_workers") < 0:
            raise agent.error(
                "num_workers",
                "it counts agent-loop worker processes",
                "set it >= 1, or 0 to run the agent loops in the driver's process",
            )
        default = agent.str("default_agent_loop")
        return cls(
            agent.int("num_workers"),
            "tool_agent" if multi_turn and default == "single_turn_agent" else default,
            agent.optional_str("agent_loop_config_path"),
            agent.optional_int("group_affinity_slack", minimum=0),
            ray_resources(agent, "resources_per_worker"),
            GatewaySettings.from_section(agent.sub("gateway")),
        )


def _sampling(section: Section, response_length: int) -> dict[str, Any]:
    """A turn's sampling settings; greedy (temperature 0) where ``do_sample`` is false, whatever ``temperature``
    says, as in verl."""
    temperature = section.float("temperature", minimum=0.0)
    return {
        "max_new_tokens": response_length,
        "temperature": temperature if section.bool("do_sample", default=True) else 0.0,
        "top_p": section.float("top_p", positive=True),
        "top_k": section.int("top_k"),
    }


@dataclass(frozen=True)
class RolloutSettings:
    """Samples per prompt (``n``, ``val_kwargs.n``) and their sampling, the budgets of a turn and of a whole call, the
    share of failed samples a batch tolerates, the agent loops' workers, the policy's servers (``servers``) and the
    reward functions the workers score samples with (``rewards``: ``custom_reward_function``, set by
    ``agentloop.settings.rollout_settings``)."""

    servers: ServerSettings
    n: int = 1
    val_n: int = 1
    sampling: dict[str, Any] = field(
        default_factory=lambda: {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    )
    val_sampling: dict[str, Any] = field(
        default_factory=lambda: {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    )
    generate_timeout_s: float = 3600.0
    max_failed_sample_ratio: float = 0.1
    free_cache_engine: bool = True
    agent: AgentSettings = AgentSettings()
    rewards: RewardSettings = RewardSettings()

    @classmethod
    def from_section(cls, rollout: Section, model_path: str) -> RolloutSettings:
        """``rollout`` is ``actor_rollout_ref.rollout``; ``model_path`` the policy's (``actor_rollout_ref.model.path``)."""
        servers = ServerSettings.from_section(rollout, model_path)
        if rollout.str("mode") != "async":
            raise rollout.error("mode", "agentloop's rollout servers are asynchronous", "set it to async")
        ratio = rollout.float("max_failed_sample_ratio", minimum=0.0)
        if ratio > 1:
            raise rollout.error("max_failed_sample_ratio", "is a share of the batch", "set it between 0 and 1")
        return cls(
            servers=servers,
            n=rollout.int("n", minimum=1),
            val_n=rollout.sub("val_kwargs").int("n", minimum=1),
            sampling=_sampling(rollout, servers.response_length),
            val_sampling=_sampling(rollout.sub("val_kwargs"), servers.response_length),
            generate_timeout_s=rollout.float("generate_timeout_s", positive=True),
            max_failed_sample_ratio=ratio,
            free_cache_engine=rollout.bool("free_cache_engine"),
            agent=AgentSettings.from_section(rollout.sub("agent"), rollout.sub("multi_turn").bool("enable")),
        )

    def sampling_params(self, validate: bool) -> dict[str, Any]:
        """A turn's sampling settings: the rollout's, or ``val_kwargs``'s when validating."""
        return dict(self.val_sampling if validate else self.sampling)
