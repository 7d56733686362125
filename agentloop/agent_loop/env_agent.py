"""``env_agent``: generate (mask 1) → ``env.step`` → stop if done → observation delta (mask 0) → repeat.

The environment class is named per row (``extra_info.env_kwargs.class_name``) or in config
(``rollout.env.class_name``) and built per sample with the row's ``env_kwargs``. A trajectory ends
with ``done`` (the env says so), ``max_turns`` (``rollout.env.max_turns`` model turns),
``length`` (the next turn or observation would not fit in ``rollout.response_length``: it never
overflows), ``context_length`` (a rewritten context would leave no room for a turn in ``rollout.max_model_len``),
``env_error`` (a step kept failing after ``max_env_retries_per_turn`` retries) or
``aborted``. A ``reset`` that fails or outlives ``step_timeout_s``, or a step whose judge call fails
(``agentloop.judge.JudgeError``), fails the sample. A reset may return the episode's opening observation (shown after
the row's prompt); an env's ``close()`` hook runs once the trajectory ends. A failed step is retried after the env's
``recover()`` hook, or after ``reset()`` and a replay of the actions so far; a turn counts only once its step
succeeds. Each turn's record keeps its step's ``info["reward"]`` (``TurnRecord.env_reward``) and the state it answered:
the env's ``state_key()`` hook when it has one, else a digest of the observation (``TurnRecord.state_key``, for GiGPO).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from hydra.utils import get_class

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.envs import BaseEnv
from agentloop.judge.session import JudgeError
from agentloop.protocol import AgentLoopOutput, EndReason, RewardParts

logger = logging.getLogger(__name__)


async def _call(function: Any, *args: Any) -> Any:
    """Await async env methods, run sync ones in a thread so a slow env never blocks the loop."""
    if inspect.iscoroutinefunction(function):
        return await function(*args)
    return await asyncio.to_thread(function, *args)


async def _state_key(env: BaseEnv) -> str | None:
    """The env's name for its current state (its optional ``state_key()`` hook), or None to use the observation."""
    if not hasattr(env, "state_key"):
        return None
    key = await _call(env.state_key)
    return None if key is None else str(key)


class EnvAgentLoop(AgentLoopBase):
    """Multi-turn rollouts against a stepped environment, with exact tokens and env retries.

    ``env_class`` / ``env_config`` let an agent-loop YAML entry bind an environment to a loop name;
    a row's ``env_kwargs.class_name`` still wins, and ``rollout.env`` is the fallback.
    """

    def __init__(
        self,
        *,
        env_class: str | None = None,
        env_config: dict[str, Any] | None = None,
        judge: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.judge = judge  # the worker's (reward_model.enable), handed to each env
        self.env_class = env_class
        self.env_config = dict(env_config or {})

    def _build_env(self, row: dict[str, Any]) -> BaseEnv:
        settings = self.rollout.env
        kwargs = dict((row.get("extra_info") or {}).get("env_kwargs") or {})
        class_name = kwargs.pop("class_name", None) or self.env_class or settings.class_name
        if not class_name:
            raise ValueError(
                "env_agent needs an environment: set rollout.env.class_name or extra_info.env_kwargs.class_name"
            )
        try:
            cls = get_class(class_name)
        except Exception as error:
            raise ValueError(f"environment class {class_name!r} cannot be imported: {error}") from error
        env = cls(**{**(settings.config or {}), **self.env_config, **kwargs})
        if self.judge is not None:
            env.judge = self.judge
        return env

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        env = self._build_env(row)
        try:
            return await self._run_episode(env, sampling_params, row)
        finally:
            if hasattr(env, "close"):  # (an env's session, a server's connection: released whatever the end)
                await self._close(env)

    async def _run_episode(self, env: BaseEnv, sampling_params: dict[str, Any], row: dict[str, Any]) -> AgentLoopOutput:
        settings = self.rollout.env
        timeout = float(settings.step_timeout_s)
        try:
            opening = await asyncio.wait_for(_call(env.reset), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the environment's reset ran past rollout.env.step_timeout_s={timeout:g}s") from None
        if opening is not None:  # the episode's opening observation follows the row's prompt
            row = {**row, "prompt": [*row["prompt"], env.format_observation(opening)]}
        trajectory = self.start_trajectory(row)
        budget = int(self.rollout.response_length)
        actions: list[str] = []
        env_reward = 0.0
        reason: EndReason
        state = await _state_key(env)
        while True:
            _, text, end = await trajectory.generate_turn(
                self.server_manager, row["request_id"], sampling_params, budget
            )
            if state is not None:
                trajectory.turns[-1].state_key = state
            if end is not None:
                reason = end
                break
            stepped = await self._step_with_retries(env, text, actions, trajectory.turns[-1].env_retries)
            if stepped is None:
                reason = "env_error"
                break
            observation, done, info = stepped
            actions.append(text)
            trajectory.turns[-1].env_reward = float((info or {}).get("reward", 0.0))
            env_reward += trajectory.turns[-1].env_reward
            if done:
                reason = "done"
                break
            if len(actions) >= int(settings.max_turns):
                reason = "max_turns"
                break
            if trajectory.add_observation_within([env.format_observation(observation)], budget) is None:
                reason = trajectory.overflow
                break
            state = await _state_key(env)

        # the reward is the worker's (agentloop.rewards): the row's reward function, else env_reward
        return trajectory.to_output(
            end_reason=reason,
            reward_parts=RewardParts(env=env_reward),
            metrics={
                "env_steps": float(len(actions)),
                "env_retries": float(sum(sum(turn.env_retries.values()) for turn in trajectory.turns)),
                "model_tokens": float(sum(turn.model_tokens for turn in trajectory.turns)),
                "observation_tokens": float(sum(turn.observation_tokens for turn in trajectory.turns)),
            },
        )

    async def _close(self, env: BaseEnv) -> None:
        """The env's ``close()`` hook, bounded by ``step_timeout_s``; its failure is logged, the trajectory stands."""
        try:
            await asyncio.wait_for(_call(env.close), float(self.rollout.env.step_timeout_s))
        except Exception as error:
            logger.warning("closing environment %s failed: %s: %s", type(env).__name__, type(error).__name__, error)

    async def _step_with_retries(
        self, env: BaseEnv, text: str, actions: list[str], retries: dict[str, int]
    ) -> tuple[Any, bool, dict[str, Any]] | None:
        """Step the env; on failure recover (hook, or reset and replay) and retry, counting failures by kind in
        ``retries`` (the turn's record). None: budget spent."""
        timeout = float(self.rollout.env.step_timeout_s)
        for attempt in range(int(self.rollout.env.max_env_retries_per_turn) + 1):
            try:
                if attempt:
                    if hasattr(env, "recover"):
                        await asyncio.wait_for(_call(env.recover), timeout)
                    else:
                        await asyncio.wait_for(_call(env.reset), timeout)
                        for action in actions:
                            await asyncio.wait_for(_call(env.step, action), timeout)
                return await asyncio.wait_for(_call(env.step, text), timeout)
            except asyncio.TimeoutError:
                kind = "timeout"
            except JudgeError:  # the judge's failure is the sample's, with the judge's text (a retry would ask again)
                raise
            except Exception as error:  # an env's failure is retried, then ends the trajectory cleanly
                kind = type(error).__name__
            retries[kind] = retries.get(kind, 0) + 1
        return None
