"""``BaseEnv``: what ``env_agent`` drives, one instance per sample. Methods may be sync or async."""

from __future__ import annotations

from typing import Any

from agentloop.judge.session import require_judge


class BaseEnv:
    """An environment stepped on each model turn.

    Subclasses implement ``step``; ``reset`` starts (or restarts) an episode, and may return the episode's opening
    observation, which (on the first reset) follows the row's prompt as ``format_observation`` shows it. An env may
    define ``close()``: called once its trajectory ends, however it ends. When a step raises or
    times out, the loop calls ``recover()`` if the env defines one, else ``reset()`` and replays the
    actions taken so far, then retries the step (``env.max_env_retries_per_turn`` times at most).
    An env may define ``state_key()``: a name (any value; compared as ``str``) for its current state, read after
    ``reset`` and after each step; turns that answer the same state form GiGPO's step groups. Without it, or when
    it returns None, the observation's text identifies the state.

    With ``reward_model.enable``, an ``async`` step may await ``self.judge`` (``agentloop.judge.Judge``, handed to the
    env by its loop: ``env_agent`` sets it after building the env) to grade the
    turn: its grade as ``info["reward"]`` is the turn's reward (``TurnRecord.env_reward``), and its feedback may go
    into the observation. A judge call that fails fails the sample (it is not retried as the env's own failures are).
    """

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    @property
    def judge(self) -> Any:
        """The worker's judge (an ``agentloop.judge.Judge``; ``reward_model.*``), handed to this env by its loop."""
        return require_judge(getattr(self, "_judge", None))

    @judge.setter
    def judge(self, judge: Any) -> None:
        self._judge = judge

    def reset(self) -> Any:
        """Start the episode; its opening observation, or None (the row's prompt opens it)."""

    def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        """Apply the model's turn: ``(observation, done, info)``; ``info["reward"]`` adds to the score."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def format_observation(self, observation: Any) -> dict[str, Any]:
        """The chat message that shows the observation to the model (a user turn by default). Its content may be
        a list of parts with images (``{"type": "image", "image": <PIL image, bytes, path or data URI>}``) for a
        vision-language model: slime's env contract."""
        return {"role": "user", "content": str(observation)}
