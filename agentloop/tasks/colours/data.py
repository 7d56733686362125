"""The colours task's pictures and rows: each picture is one colour (red, green or blue, in a random shade,
size and with a few grey specks), so the answer to "what colour is this picture?" is only in its pixels.

A row shows the first picture of an episode (verl's ``<image>`` placeholder plus the ``images`` column, as
PNG bytes); the row's environment (``ColoursEnv``, in ``extra_info.env_kwargs``) redraws the same episode
from its key and shows the next pictures, one per turn.

    python -m agentloop.tasks.colours.data --out data/colours --train 512 --test 64
"""

from __future__ import annotations

import argparse
import hashlib
import io
import random
from typing import Any

from PIL import Image, ImageDraw

from agentloop.models.cache import cache_root
from agentloop.rows import write_rows, write_rows_once
from agentloop.tasks.colours.reward import COLOURS

ENV_CLASS = "agentloop.tasks.colours.env.ColoursEnv"
SYSTEM = "Answer with one letter: R for red, G for green, B for blue."
QUESTION = "What colour is this picture?"
FOLLOW_UP = "And this one?"
# (width, height) in pixels: 4 or 6 image tokens for the tiny VLM (28x28 pixels per token)
SIZES = ((56, 56), (84, 56), (56, 84))
_BASE = {"red": (200, 40, 40), "green": (40, 180, 50), "blue": (40, 60, 210)}


def draw(colour: str, rng: random.Random) -> Image.Image:
    """A picture filled with a random shade of ``colour``, at a random size, with one to three grey specks
    (noise that carries no answer)."""
    width, height = rng.choice(SIZES)
    shade = tuple(max(0, min(255, channel + rng.randint(-30, 30))) for channel in _BASE[colour])
    image = Image.new("RGB", (width, height), shade)
    pen = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 3)):
        x, y, side = rng.randint(0, width - 12), rng.randint(0, height - 12), rng.randint(4, 12)
        grey = rng.randint(60, 230)
        pen.rectangle((x, y, x + side - 1, y + side - 1), fill=(grey, grey, grey))
    return image


def episode(key: str, turns: int) -> list[tuple[str, Image.Image]]:
    """The ``(colour, picture)`` of each turn of the episode ``key`` (deterministic: the row and its
    environment draw the same pictures)."""
    rng = random.Random(f"colours-{key}")
    return [(colour, draw(colour, rng)) for colour in (rng.choice(COLOURS) for _ in range(turns))]


def png(image: Image.Image) -> bytes:
    """The image as PNG bytes (how the rows store it: parquet-style ``{"bytes": ...}``)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_rows(count: int, seed: int = 0, split: str = "train", turns: int = 2) -> list[dict[str, Any]]:
    """``count`` episodes of ``turns`` pictures (deterministic for a seed and split), each an ``env_agent`` row
    showing the first picture; ``reward_model.ground_truth`` lists the colours, space-separated."""
    if turns < 1:
        raise ValueError(f"colours task: turns must be at least 1, got {turns}")
    rows = []
    for index in range(count):
        key = f"{seed}-{split}-{index}"
        pictures = episode(key, turns)
        rows.append(
            {
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"<image>{QUESTION}"}],
                "images": [{"bytes": png(pictures[0][1])}],
                "agent_name": "env_agent",
                "data_source": "colours",
                "reward_model": {"style": "rule", "ground_truth": " ".join(colour for colour, _ in pictures)},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "env_kwargs": {"class_name": ENV_CLASS, "episode": key, "turns": turns},
                },
            }
        )
    return rows


def cached_split(split: str, count: int, turns: int = 2, seed: int = 0) -> str:
    """A cached parquet of ``make_rows(count, seed, split, turns)``, written on first use (keyed by the texts
    and colours too, so a change to the task never reads stale rows)."""
    design = hashlib.sha256(repr((SYSTEM, QUESTION, FOLLOW_UP, SIZES, _BASE)).encode()).hexdigest()[:8]
    path = cache_root() / "data" / f"colours-{count}-{turns}-{seed}-{design}" / f"{split}.parquet"
    return write_rows_once(path, lambda: make_rows(count, seed, split, turns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/colours")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split, count in (("train", args.train), ("test", args.test)):
        print(write_rows(make_rows(count, args.seed, split, args.turns), f"{args.out}/{split}.parquet"))


if __name__ == "__main__":
    main()
