"""``CorridorEnv``: judges each junction's left/right choice and shows the next junction."""

from __future__ import annotations

import re
from typing import Any

from agentloop.envs import BaseEnv
from agentloop.tasks.corridor.data import SIDES, clue, episode as draw_episode

_WORD = re.compile(r"[a-z]+")


def answer_side(text: str) -> str | None:
    """The side a turn chooses: its first word, lower-cased, when it is ``left`` or ``right``; else None (only the
    first word counts, so "left right" never earns a point)."""
    word = _WORD.search(text.lower())
    return word.group() if word is not None and word.group() in SIDES else None


class CorridorEnv(BaseEnv):
    """One episode of ``turns`` junctions drawn from ``episode`` (its key, from the row's ``env_kwargs``).

    The row's prompt shows junction 0; each step judges the choice at the junction on show (``info["reward"]``:
    ``1/turns`` when right, so a fully right episode scores 1.0) and shows the next junction whatever the choice
    was (a wrong turn is a dead end, walked back): every trajectory of an episode sees the same junctions, and
    only its choices differ. The episode is done after the last choice.
    """

    def __init__(self, episode: str, turns: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key, self.turns = str(episode), int(turns)

    def reset(self) -> None:
        self.sides = draw_episode(self.key, self.turns)
        self.junction = 0

    def step(self, response_text: str) -> tuple[int, bool, dict[str, Any]]:
        correct = float(answer_side(response_text) == self.sides[self.junction])
        self.junction += 1
        return self.junction, self.junction >= self.turns, {"reward": correct / self.turns, "correct": correct}

    def format_observation(self, observation: int) -> dict[str, Any]:
        """Junction number ``observation`` (the next to choose at) and its clue."""
        return {"role": "user", "content": clue(observation, self.sides)}
