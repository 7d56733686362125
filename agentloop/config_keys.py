"""Which keys agentloop's config has, read from its own YAML files: the known keys, verl's keys it accepts
but ignores, the keys a composed config has that are neither, and the known keys closest to a mistyped one.

``ppo_trainer.yaml`` holds the implemented keys; ``verl_ignored.yaml`` the rest of verl's ``ppo_trainer``,
each null until a run sets it. Hydra itself rejects an unknown key only on the command line: one in a
user's YAML merges silently, which is why a composed config is checked here as well.
"""

from __future__ import annotations

from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

IMPLEMENTED_FILE = "ppo_trainer.yaml"
IGNORED_FILE = "verl_ignored.yaml"
# verl switches that are always on here: false does nothing, so it is reported with the ignored keys
ALWAYS_ON = ("data.return_raw_chat", "actor_rollout_ref.rollout.calculate_log_probs")
# mappings whose entries are the user's own names rather than config keys (besides those empty by default)
OPEN_MAPPINGS = (
    "actor_rollout_ref.rollout.resources_per_server",
    "reward_model.rollout.resources_per_server",
    "task.prepare",
)


def leaf_paths(node: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested mapping by dotted path; an empty mapping counts as a leaf."""
    if not isinstance(node, Mapping) or not node:
        return {prefix: node} if prefix else {}
    leaves: dict[str, Any] = {}
    for key, value in node.items():
        leaves.update(leaf_paths(value, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


def _plain(config: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    # unresolved: reading keys must not build models or fail on a user's interpolation
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=False, throw_on_missing=False)
    return dict(config)


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def _select(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


class ConfigKeys:
    """The key table of one config directory (see the module docstring)."""

    def __init__(self, implemented: Mapping[str, Any], ignored: Mapping[str, Any]) -> None:
        own = leaf_paths(implemented)
        # a key ppo_trainer.yaml defines is implemented, even when verl_ignored.yaml still lists it
        overlaps = {prefix for path in own for prefix in _prefixes(path)}
        self.ignored = {
            path: default
            for path, default in leaf_paths(ignored).items()
            if path not in overlaps and not any(prefix in own for prefix in _prefixes(path))
        }
        self.leaves = {**own, **self.ignored}
        self.nodes = {prefix for path in self.leaves for prefix in _prefixes(path)}
        # below a leaf (a {} mapping, or a null a user fills with one) the names are the user's own
        self.open = set(self.leaves) | set(OPEN_MAPPINGS)

    @classmethod
    def from_dir(cls, directory: Path) -> ConfigKeys:
        """The table of ``directory``'s ``ppo_trainer.yaml`` and ``verl_ignored.yaml``."""
        implemented = _plain(OmegaConf.load(directory / IMPLEMENTED_FILE))
        implemented.pop("defaults", None)
        return cls(implemented, _plain(OmegaConf.load(directory / IGNORED_FILE)))

    def is_known(self, path: str) -> bool:
        """A key of the config, or a name inside a mapping of the user's own (``by_data_source``, ...)."""
        return path in self.nodes or any(prefix in self.open for prefix in _prefixes(path)[:-1])

    def unknown(self, config: DictConfig | Mapping[str, Any]) -> list[str]:
        """The keys of a composed config that agentloop does not know, sorted."""
        return sorted(path for path in leaf_paths(_plain(config)) if not self.is_known(path))

    def ignored_settings(self, config: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
        """The ignored keys this config sets (to anything but null / {}), and always-on switches set to false."""
        tree = _plain(config)
        settings: dict[str, Any] = {}
        for path in self.ignored:
            value = _select(tree, path)
            if isinstance(value, Mapping):
                if value:  # the entries a user put in one of verl's {} mappings
                    settings.update(leaf_paths(value, path))
            elif value is not None:
                settings[path] = value
        settings.update({path: False for path in ALWAYS_ON if _select(tree, path) is False})
        return settings

    def closest(self, path: str, count: int = 5) -> list[str]:
        """Known keys most like ``path``: a similar last name first, then a similar section."""
        section, _, name = path.rpartition(".")

        def likeness(key: str) -> tuple[float, float]:
            key_section, _, key_name = key.rpartition(".")
            return SequenceMatcher(None, name, key_name).ratio(), SequenceMatcher(None, section, key_section).ratio()

        scored = [(likeness(key), key) for key in self.leaves]
        scored = [(0.7 * by_name + 0.3 * by_section, key) for (by_name, by_section), key in scored if by_name >= 0.6]
        return [key for _, key in sorted(scored, key=lambda pair: (-pair[0], pair[1]))[:count]]

    def describe_unknown(self, path: str) -> str:
        """One line naming the closest known keys to ``path``."""
        closest = self.closest(path)
        return (
            f"closest known keys to {path!r}: {', '.join(closest)}" if closest else f"no known key resembles {path!r}"
        )
