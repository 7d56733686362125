"""``RewardSettings``: ``custom_reward_function`` as the reward step reads it (``agentloop.rewards``), typed and
checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentloop.settings.reading import Section


@dataclass(frozen=True)
class RewardSettings:
    """Which function scores a sample: by its data source (``by_data_source``: dotted paths), else ``name`` in
    ``path`` (a ``.py`` file or ``pkg://module``, None: none) called with ``reward_kwargs``; each call bounded by
    ``timeout_s``. ``response_length`` (``actor_rollout_ref.rollout.response_length``) cuts each segment's response
    as the batch holds it before it is decoded for the function."""

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    by_data_source: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 60.0
    response_length: int = 256

    @classmethod
    def from_section(cls, section: Section, response_length: int) -> RewardSettings:
        """The settings of ``section`` (``custom_reward_function``; null or absent keys take their defaults)."""
        timeout = section.float("timeout_s", positive=True) if section.raw("timeout_s") is not None else 60.0
        return cls(
            path=section.optional_str("path"),
            name=section.optional_str("name") or "compute_score",
            reward_kwargs=section.mapping("reward_kwargs"),
            # a null entry leaves its data source to the next rule
            by_data_source={
                str(source): str(path) for source, path in section.mapping("by_data_source").items() if path
            },
            timeout_s=timeout,
            response_length=response_length,
        )
