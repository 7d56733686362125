"""``Section``: one section of the composed config, read once with its full key in every error.

Settings classes (``agentloop.settings``) read their section through it, so a bad value is refused where it is
read, as ``actor_rollout_ref.rollout.n=0: ...; set it to ...``, and nothing downstream casts again.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")


class Section:
    """The config node at ``key`` (e.g. ``actor_rollout_ref.rollout``); each reader names ``key.name`` when it fails."""

    def __init__(self, node: DictConfig | Mapping[str, Any] | None, key: str) -> None:
        self.node = node if node is not None else {}
        self.key = key

    def sub(self, name: str) -> Section:
        """The section below, at ``key.name``."""
        return Section(self.raw(name), f"{self.key}.{name}")

    def raw(self, name: str, default: Any = None) -> Any:
        """The value as the config holds it (``default`` when absent)."""
        value = self.node.get(name, default)
        if isinstance(value, DictConfig) or OmegaConf.is_list(value):
            return OmegaConf.to_container(value, resolve=True)
        return value

    def error(self, name: str, why: str, fix: str) -> ValueError:
        """``key.name=value: why; fix``."""
        return ValueError(f"{self.key}.{name}={self.raw(name)!r}: {why}; {fix}")

    def _cast(self, name: str, cast: Callable[[Any], T], kind: str, default: Any) -> T:
        value = self.raw(name, default)
        if isinstance(value, bool) and cast is not bool:
            raise self.error(name, f"is not {kind}", f"set it to {kind}")
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise self.error(name, f"is not {kind}", f"set it to {kind}") from None

    def int(self, name: str, minimum: int | None = None, default: Any = None) -> int:
        """An integer, at least ``minimum`` when given."""
        value = self._cast(name, _whole, "an integer", default)
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be at least {minimum}", f"set it to {minimum} or more")
        return value

    def optional_int(self, name: str, minimum: int | None = None) -> int | None:
        """An integer, or None where the config holds null."""
        return None if self.raw(name) is None else self.int(name, minimum)

    def float(self, name: str, minimum: float | None = None, positive: bool = False, default: Any = None) -> float:
        """A number, at least ``minimum`` (above 0 with ``positive``) when given."""
        value = self._cast(name, float, "a number", default)
        if positive and value <= 0:
            raise self.error(name, "must be above 0", "set it to a positive number")
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be at least {minimum:g}", f"set it to {minimum:g} or more")
        return value

    def bool(self, name: str, default: Any = None) -> bool:
        """true or false."""
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise self.error(name, "is not true or false", "set it to true or false")
        return value

    def str(self, name: str, choices: Sequence[str] | None = None, default: Any = None) -> str:
        """A non-empty string, one of ``choices`` when given."""
        value = self.raw(name, default)
        if value is None or value == "":
            raise self.error(name, "is empty", f"set it to one of {list(choices)}" if choices else "set it")
        if choices is not None and str(value) not in choices:
            raise self.error(name, "is not a known choice", f"choose one of {list(choices)}")
        return str(value)

    def optional_str(self, name: str) -> str | None:
        """A string, or None where the config holds null (or an empty string)."""
        value = self.raw(name)
        return None if value is None or value == "" else str(value)

    def strings(self, name: str) -> tuple[str, ...]:
        """A list of strings (null: none)."""
        value = self.raw(name) or []
        if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
            raise self.error(name, "is not a list", "write it as a list, e.g. [a, b]")
        return tuple(str(item) for item in value)

    def mapping(self, name: str) -> dict[str, Any]:
        """A mapping (null: empty)."""
        value = self.raw(name) or {}
        if not isinstance(value, Mapping):
            raise self.error(name, "is not a mapping", "write it as a mapping, e.g. {key: value}")
        return dict(value)


def _whole(value: Any) -> int:
    number = float(value)
    if not number.is_integer():
        raise ValueError(value)
    return int(number)
