"""Reading and judging a colour answer: the turn's first word, a colour's initial (``R``, ``G``, ``B``, what the
task asks for) or its name.

The task asks for the initial because it is one token for the tiny model's tokenizer, while the names are two
or three that share pieces (``re|d``, ``g|re|en``): measured on CPU, GRPO at a learning rate that learns within
minutes pulls those pieces apart ("breen", "glue") and then collapses onto one colour; one token per answer
makes each turn a clean three-way choice.
"""

from __future__ import annotations

import re

COLOURS = ("red", "green", "blue")
INITIALS = {colour[0].upper(): colour for colour in COLOURS}
_WORD = re.compile(r"[a-z]+")


def answer_colour(text: str) -> str | None:
    """The colour a turn answers: its first word, lower-cased, as an initial (``r``) or a name (``red``); None
    when it is neither. Only the first word counts, so listing every colour ("R G B") never earns a point."""
    word = _WORD.search(text.lower())
    if word is None:
        return None
    word = word.group()
    return INITIALS.get(word.upper()) or (word if word in COLOURS else None)


def score_answer(text: str, colour: str) -> float:
    """1.0 when the turn ``text`` answers ``colour``, else 0.0."""
    return float(answer_colour(text) == colour)
