"""``ColoursEnv``: judges each turn's colour answer and shows the episode's next picture."""

from __future__ import annotations

from typing import Any

from agentloop.envs import BaseEnv
from agentloop.tasks.colours.data import FOLLOW_UP, episode as draw_episode
from agentloop.tasks.colours.reward import score_answer


class ColoursEnv(BaseEnv):
    """One episode of ``turns`` pictures drawn from ``episode`` (its key, from the row's ``env_kwargs``).

    The row's prompt shows picture 0; each step judges the answer to the picture on show (``info["reward"]``:
    ``1/turns`` when right, so a fully right episode scores 1.0) and shows the next one, as a user turn with
    an image part; the episode is done after the last answer.
    """

    def __init__(self, episode: str, turns: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key, self.turns = str(episode), int(turns)

    def reset(self) -> None:
        self.pictures = draw_episode(self.key, self.turns)
        self.turn = 0

    def step(self, response_text: str) -> tuple[int, bool, dict[str, Any]]:
        colour = self.pictures[self.turn][0]
        correct = score_answer(response_text, colour)
        self.turn += 1
        return self.turn, self.turn >= self.turns, {"reward": correct / self.turns, "correct": correct}

    def format_observation(self, observation: int) -> dict[str, Any]:
        """Picture number ``observation`` (the next to answer), with the follow-up question."""
        return {
            "role": "user",
            "content": [{"type": "image", "image": self.pictures[observation][1]}, {"type": "text", "text": FOLLOW_UP}],
        }
