"""``BaseInteraction`` and the YAML that names interactions (``multi_turn.interaction_config_path``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from hydra.utils import get_class


class BaseInteraction:
    """A simulated user. One instance serves every trajectory; state lives under ``instance_id``."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config)
        self.name = self.config.get("name", type(self).__name__)

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
def load_interactions(path: str | None) -> dict[str, BaseInteraction]:
    """Build the interactions listed in a YAML file (``interaction: [{name, class_name, config}]``)."""
    if not path:
        return {}
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"interaction config {path!r} does not exist (actor_rollout_ref.rollout.multi_turn.interaction_config_path)"
        )
    document = yaml.safe_load(file.read_text()) or {}
    entries = document.get("interaction") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with an 'interaction' list of {{name, class_name, config}}")
    interactions: dict[str, BaseInteraction] = {}
    for position, entry in enumerate(entries):
        where = f"{path}: interaction[{position}]"
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise ValueError(f"{where}: missing field 'class_name'")
        try:
            cls = get_class(entry["class_name"])
        except Exception as error:
            raise ValueError(f"{where}.class_name = {entry['class_name']!r} cannot be imported: {error}") from error
        if not issubclass(cls, BaseInteraction):
            raise ValueError(f"{where}.class_name = {entry['class_name']!r} is not a subclass of BaseInteraction")
        name = entry.get("name") or cls.__name__
        interactions[name] = cls({**(entry.get("config") or {}), "name": name})
    return interactions
