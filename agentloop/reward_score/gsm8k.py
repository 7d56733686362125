"""GSM8K-style answers: the number after ``#### `` (``strict``) or the last number in the text (``flexible``).

Scores as verl's ``gsm8k`` scorer does, so the same response gets the same reward here and there: only
the last 300 characters are searched, commas (and ``$`` in strict mode) are dropped from the number,
and the comparison with the ground truth is an exact string match.
"""

from __future__ import annotations

import re

# The answer sits at the end of a response; searching only its tail keeps the regex cheap on long ones.
TAIL_CHARS = 300

_MARKED = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in ``solution_str``, or None when it has none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r}; choose strict or flexible")
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        marked = _MARKED.findall(tail)
        return marked[-1].replace(",", "").replace("$", "") if marked else None
    numbers = [number for number in _NUMBER.findall(tail) if number not in ("", ".")]
    return numbers[-1] if numbers else None


def compute_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one, 0 when there is no answer."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
