"""A number-guessing game for ``env_agent``: the model guesses, the env answers higher / lower."""

from __future__ import annotations

import random
import re

from agentloop.envs import BaseEnv

_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnv(BaseEnv):
    """Secret integer in [low, high] (seeded per row); reward 1.0 on the turn the model finds it."""

    def __init__(self, seed: int = 0, low: int = 1, high: int = 100) -> None:
        super().__init__(seed=seed, low=low, high=high)
        self.secret = random.Random(seed).randint(low, high)

    def reset(self) -> None:
        self.guesses: list[int] = []

    def step(self, response_text: str):
        numbers = _INTEGER.findall(response_text)
        if not numbers:
            return "Answer with a number.", False, {"reward": 0.0}
        guess = int(numbers[-1])
        self.guesses.append(guess)
        if guess == self.secret:
            return "Correct!", True, {"reward": 1.0}
        return ("Higher." if guess < self.secret else "Lower."), False, {"reward": 0.0}
