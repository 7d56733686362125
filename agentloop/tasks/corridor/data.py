"""The corridor task's episodes and rows: ``turns`` junctions, each with a clue to the way on (the side a
draught comes from), drawn at random.

A row shows the first junction (``env_agent``, its environment ``CorridorEnv`` in ``extra_info.env_kwargs``);
the environment redraws the same episode from its key and shows the next junctions, one per turn.

    python -m agentloop.tasks.corridor.data --out data/corridor --train 512 --test 64
"""

from __future__ import annotations

import argparse
import hashlib
import random
from typing import Any

from agentloop.models.cache import cache_root
from agentloop.rows import write_rows, write_rows_once

ENV_CLASS = "agentloop.tasks.corridor.env.CorridorEnv"
SIDES = ("left", "right")
SYSTEM = "You walk down a corridor. At each junction, answer left or right: the side the draught comes from."
CLUE = "Junction {number} of {turns}: a draught comes from the {side}."


def episode(key: str, turns: int) -> list[str]:
    """The right side at each junction of the episode ``key`` (deterministic: the row and its environment agree)."""
    rng = random.Random(f"corridor-{key}")
    return [rng.choice(SIDES) for _ in range(turns)]


def clue(junction: int, sides: list[str]) -> str:
    """What the model is told at ``junction`` (0-based) of an episode: which junction, and the side of the way on."""
    return CLUE.format(number=junction + 1, turns=len(sides), side=sides[junction])


def make_rows(count: int, seed: int = 0, split: str = "train", turns: int = 4) -> list[dict[str, Any]]:
    """``count`` episodes of ``turns`` junctions (deterministic for a seed and split), each an ``env_agent`` row
    showing the first junction; ``reward_model.ground_truth`` lists the right sides, space-separated."""
    if turns < 1:
        raise ValueError(f"corridor task: turns must be at least 1, got {turns}")
    rows = []
    for index in range(count):
        key = f"{seed}-{split}-{index}"
        sides = episode(key, turns)
        rows.append(
            {
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": clue(0, sides)}],
                "agent_name": "env_agent",
                "data_source": "corridor",
                "reward_model": {"style": "rule", "ground_truth": " ".join(sides)},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "env_kwargs": {"class_name": ENV_CLASS, "episode": key, "turns": turns},
                },
            }
        )
    return rows


def cached_split(split: str, count: int, turns: int = 4, seed: int = 0) -> str:
    """A cached parquet of ``make_rows(count, seed, split, turns)``, written on first use (keyed by the texts too,
    so a change to the task never reads stale rows)."""
    design = hashlib.sha256(repr((SYSTEM, CLUE, SIDES)).encode()).hexdigest()[:8]
    path = cache_root() / "data" / f"corridor-{count}-{turns}-{seed}-{design}" / f"{split}.parquet"
    return write_rows_once(path, lambda: make_rows(count, seed, split, turns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/corridor")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, count in (("train", args.train), ("test", args.test)):
        print(write_rows(make_rows(count, args.seed, split, args.turns), f"{args.out}/{split}.parquet"))


if __name__ == "__main__":
    main()
