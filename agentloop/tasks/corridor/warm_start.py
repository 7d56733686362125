"""The corridor task's supervised warm start: the answer form, and a skill the starting policy does not use.

A random tiny model writes noise, so GRPO would see reward 0 everywhere. The warm start trains it on the task's
own conversations (same system prompt and clues as a rollout) in two passes: first every answer follows its
junction's clue, then a shorter pass where every answer is ``left`` or ``right`` drawn at random, independently of
the clue. The starting policy answers in the right form and is right about half the time at every junction (mean
reward about 1/2, with the spread GRPO needs), and reinforcement has one thing to learn: follow each clue again.

Why the first pass: with the random-answer pass alone, reading the clue has to be learned from scratch, and GRPO
moved nothing in 30 steps (8 prompts x 8 samples; lr 1e-3 and 3e-3 stayed at 0.5, 1e-2 broke the answer form),
which makes a benchmark of 30-step runs compare noise. With the reading of the clue learned once and then
unlearned as a policy, GRPO brings it back within about 20 steps, and how fast it does is what the advantage
estimators differ in.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from transformers import AutoTokenizer

from agentloop.models.cache import cache_root
from agentloop.models.sft import finetune
from agentloop.models.tiny_qwen import tiny_model_path
from agentloop.tasks.corridor.data import SIDES, clue, episode, make_rows


def conversation(row: dict[str, Any], rng: random.Random | None) -> list[dict[str, Any]]:
    """The row's episode as a chat: every answer follows its clue (``rng`` None), or is a side drawn from ``rng``."""
    settings = row["extra_info"]["env_kwargs"]
    sides = episode(settings["episode"], int(settings["turns"]))
    chat = list(row["prompt"])
    for junction, side in enumerate(sides):
        if junction:
            chat.append({"role": "user", "content": clue(junction, sides)})
        chat.append({"role": "assistant", "content": side if rng is None else rng.choice(SIDES)})
    return chat


def warm_start_path(count: int = 256, turns: int = 4, seed: int = 0) -> str:
    """Directory of the warm-started tiny model, trained on first use (a minute or two on CPU) and cached.

    ``count`` episodes of their own split (never the train or test rows); 80 AdamW steps of 16 conversations at
    lr 3e-3 that follow the clues (0.97 of the probability on the right side after them), then 30 at 1e-3 with
    random sides (0.48-0.51 at each junction). Each directory is keyed by its base model and conversations.
    """
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(seed)
    rows = make_rows(count, seed, split="warm_start", turns=turns)
    following = [tokenizer.apply_chat_template(conversation(row, None), tokenize=False) for row in rows]
    random_sides = [tokenizer.apply_chat_template(conversation(row, rng), tokenize=False) for row in rows]
    models = cache_root() / "models"
    skilled = finetune(
        base,
        following,
        str(models / f"corridor-clues-{_key(base, following, seed)}"),
        steps=80,
        lr=3e-3,
        batch_size=16,
        seed=seed,
        desc="warm start 1/2 (first run only): follow the clues",
    )
    return finetune(
        skilled,
        random_sides,
        str(models / f"corridor-warm-start-{_key(skilled, random_sides, seed)}"),
        steps=30,
        lr=1e-3,
        batch_size=16,
        seed=seed,
        desc="warm start 2/2 (first run only): left or right at random",
    )


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
