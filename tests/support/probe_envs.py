"""Environments and an interaction with scripted behaviour, for the env_agent and interaction tests."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.envs import BaseEnv
from agentloop.interactions import BaseInteraction


class DoneAtTurn2Env(BaseEnv):
    def reset(self) -> None:
        self.steps = 0

    def step(self, response_text: str):
        self.steps += 1
        return f"observation {self.steps}", self.steps == 2, {"reward": 0.5}

    def state_key(self) -> str:
        return f"position {self.steps}"


class NeverDoneEnv(BaseEnv):
    def step(self, response_text: str):
        return "keep going", False, {}


class BigObservationEnv(BaseEnv):
    def step(self, response_text: str):
        return "lots of text " * 40, False, {}


class FlakyEnv(BaseEnv):
    """Every other step call raises; ``recover`` is its own recovery hook (no reset, no replay)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = self.steps = self.recoveries = 0

    def step(self, response_text: str):
        self.calls += 1
        if self.calls % 2 == 0:
            raise ConnectionError("flaky")
        self.steps += 1
        return f"step {self.steps}", self.steps == 3, {}

    def recover(self) -> None:
        self.recoveries += 1


class FailsOnceEnv(BaseEnv):
    """The second turn's first attempt raises; recovery is reset and replay of the actions so far."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failed = False
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        self.history: list[str] = []

    def step(self, response_text: str):
        if len(self.history) == 1 and not self.failed:
            self.failed = True
            raise RuntimeError("lost connection")
        self.history.append(response_text)
        return f"history {len(self.history)} after {self.resets} resets", len(self.history) == 2, {}


class AlwaysFailsEnv(BaseEnv):
    def step(self, response_text: str):
        raise RuntimeError("broken")


class SlowEnv(BaseEnv):
    async def step(self, response_text: str):
        await asyncio.sleep(5)
        return "late", False, {}


class CountingInteraction(BaseInteraction):
    """Says "try again" until the model has answered ``turns`` times, then ends the conversation."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.counts: dict[str, int] = {}

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        self.counts[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        self.counts[instance_id] += 1
        if self.counts[instance_id] >= int(kwargs.get("turns", self.config["turns"])):
            return True, "", 1.0, {}
        return False, f"try again ({self.counts[instance_id]})", 0.5, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.counts[instance_id])

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.counts.pop(instance_id, None)
