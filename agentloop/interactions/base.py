"""``BaseInteraction`` and the YAML that names interactions (``multi_turn.interaction_config_path``)."""

from __future__ import annotations

import functools
from typing import Any

from agentloop.judge.session import require_judge
from agentloop.yaml_entries import entry_class, read_entries


class BaseInteraction:
    """A simulated user. One instance serves every trajectory; state lives under ``instance_id``. With
    ``reward_model.enable``, ``generate_response`` may await ``self.judge`` to grade the turn (its ``turn_score``): the
    worker's judge, given to the interactions built for it (``load_interactions``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config)
        self.name = self.config.get("name", type(self).__name__)

    @property
    def judge(self) -> Any:
        """The worker's judge (an ``agentloop.judge.Judge``; ``reward_model.*``)."""
        return require_judge(getattr(self, "_judge", None))

    @judge.setter
    def judge(self, judge: Any) -> None:
        self._judge = judge

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        """Begin a conversation (``kwargs`` come from the row's ``extra_info.interaction_kwargs``)."""
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Answer the model: ``(should_terminate, text, turn_score, extra)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_response()")

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The trajectory-level score this interaction assigns (0.0 by default)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Drop per-conversation state."""


@functools.lru_cache(maxsize=None)
def load_interactions(path: str | None, judge: Any = None) -> dict[str, BaseInteraction]:
    """Build the interactions listed in a YAML file (``interaction: [{name, class_name, config}]``), once per file and
    ``judge`` (a worker's ``agentloop.judge.Judge``, their ``self.judge``; None: no judge is served)."""
    if not path:
        return {}
    interactions: dict[str, BaseInteraction] = {}
    for where, entry in read_entries(path, "interaction", "multi_turn.interaction_config_path"):
        cls = entry_class(entry, where, BaseInteraction)
        name = entry.get("name") or cls.__name__
        interactions[name] = cls({**(entry.get("config") or {}), "name": name})
        if judge is not None:
            interactions[name].judge = judge
    return interactions


def check_interaction_config(path: str) -> set[str]:
    """Every interaction's class importable, without building one; returns their names."""
    names = set()
    for where, entry in read_entries(path, "interaction", "multi_turn.interaction_config_path"):
        cls = entry_class(entry, where, BaseInteraction)
        names.add(entry.get("name") or cls.__name__)
    return names
