"""The colours task's supervised warm start: the answer FORMAT only, never the answer.

The random tiny VLM writes noise, so GRPO would see reward 0 everywhere. The warm start trains it on the
task's own conversations (same system prompt, question, pictures and follow-up observation as a rollout)
in which every answer is one colour initial (R, G or B) chosen uniformly at random, independently of the
picture, then the end of the turn. The starting policy therefore answers in the right form with the right odds by chance
(mean reward about 1/3), and reinforcement has one thing to learn: read the colour off the image.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from agentloop.models.cache import cache_root
from agentloop.models.sft import finetune_chats
from agentloop.models.tiny_vlm import tiny_vlm_path
from agentloop.tasks.colours.data import FOLLOW_UP, episode, make_rows, png
from agentloop.tasks.colours.reward import INITIALS


def conversation(row: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    """The row's episode as a chat with images in content parts, every answer a random colour initial."""
    turns = int(row["extra_info"]["env_kwargs"]["turns"])
    pictures = episode(row["extra_info"]["env_kwargs"]["episode"], turns)
    system, user = row["prompt"]
    question = user["content"].replace("<image>", "")
    chat = [
        system,
        {"role": "user", "content": [{"type": "image", "image": pictures[0][1]}, {"type": "text", "text": question}]},
    ]
    for turn in range(turns):
        if turn:
            chat.append(
                {
                    "role": "user",
                    "content": [{"type": "image", "image": pictures[turn][1]}, {"type": "text", "text": FOLLOW_UP}],
                }
            )
        chat.append({"role": "assistant", "content": rng.choice(sorted(INITIALS))})
    return chat


def warm_start_path(count: int = 256, turns: int = 2, steps: int = 120, lr: float = 3e-3, seed: int = 0) -> str:
    """Directory of the warm-started tiny VLM, trained on first use (a few seconds on CPU) and cached.

    ``count`` episodes of their own split (never the train or test rows), ``steps`` AdamW steps of 16
    conversations at ``lr``; the directory is keyed by the base model, every conversation (its text and
    pictures) and these settings, so any change trains a new one.
    """
    base = tiny_vlm_path()
    rng = random.Random(seed)
    chats = [conversation(row, rng) for row in make_rows(count, seed, split="warm_start", turns=turns)]
    key = hashlib.sha256(repr((base, steps, lr, seed, [_fingerprint(chat) for chat in chats])).encode()).hexdigest()[
        :16
    ]
    return finetune_chats(
        base,
        chats,
        str(cache_root() / "models" / f"colours-warm-start-{key}"),
        steps=steps,
        lr=lr,
        seed=seed,
        batch_size=16,
        desc="warm start (first run only): answer with one colour initial",
    )


def _fingerprint(chat: list[dict[str, Any]]) -> list[Any]:
    """A conversation with its pictures as PNG digests: what the cache key hashes."""

    def part(piece: dict[str, Any]) -> Any:
        return hashlib.sha256(png(piece["image"])).hexdigest() if piece.get("type") == "image" else piece.get("text")

    return [
        (m["role"], m["content"] if isinstance(m["content"], str) else [part(p) for p in m["content"]]) for m in chat
    ]
