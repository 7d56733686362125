"""OpenEnv environments written against ``openenv-core``'s public API only, as an environment package would be, and
the server app of the first (``create_app``; ``uvicorn tests.support.openenv_envs:app``).

- ``CountingEnvironment``: opens with ``say ok``, answers each action with ``count <n>``, rewards ``ok`` with 1 and
  anything else with 0, done after three steps;
- ``RaisingEnvironment``, ``HangingEnvironment``, ``MalformedEnvironment``: open like it, then on a step raise, never
  return, or return a reward that is not a number;
- ``DyingEnvironment``: its server process dies on the episode's second step (``dying_app``).
"""

from __future__ import annotations

import os
import time
from typing import Any
from uuid import uuid4

from openenv.core import Action, Environment, Observation, State, create_app
from pydantic import Field


class SayAction(Action):
    message: str = Field(..., description="what the model said")


class CountObservation(Observation):
    text: str = Field(default="", description="what the environment says")


class CountingEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, turns: int = 3) -> None:
        super().__init__()
        self.turns = turns
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CountObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CountObservation(text="say ok", done=False, reward=0.0)

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:  # type: ignore[override]
        self._state.step_count += 1
        reward = 1.0 if action.message == "ok" else 0.0
        return CountObservation(
            text=f"count {self._state.step_count}", done=self._state.step_count >= self.turns, reward=reward
        )

    @property
    def state(self) -> State:
        return self._state


class RaisingEnvironment(CountingEnvironment):
    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:  # type: ignore[override]
        raise RuntimeError("the environment's own bug")


class HangingEnvironment(CountingEnvironment):
    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:  # type: ignore[override]
        time.sleep(20)  # far past any step timeout, short enough that the process's exit need not wait long for it
        raise AssertionError("a step past its timeout was not abandoned")


class MalformedEnvironment(CountingEnvironment):
    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        return {"text": "count 1", "reward": "lots"}


class DyingEnvironment(CountingEnvironment):
    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:  # type: ignore[override]
        if self._state.step_count == 1:
            os._exit(1)  # the whole server, mid-episode
        return super().step(action)


app = create_app(CountingEnvironment, SayAction, CountObservation, env_name="counting", max_concurrent_envs=16)
dying_app = create_app(DyingEnvironment, SayAction, CountObservation, env_name="dying", max_concurrent_envs=16)
