r"""Boxed math answers (MATH, MATH-500): the last ``\boxed{...}`` compared with the ground truth after
normalising both LaTeX strings (the Hendrycks MATH normalisation that verl's ``math_reward`` also uses:
``dfrac``/``tfrac`` as ``frac``, no ``\left``/``\right``, spaces, dollars, degrees, percent signs or
units, ``\frac12`` and ``1/2`` as ``\frac{1}{2}``, ``0.5`` as ``\frac{1}{2}``, ``x = 3`` as ``3``).
"""

from __future__ import annotations

import re


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals the ground truth after normalisation, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    answer = remove_boxed(boxed)
    return 1.0 if answer is not None and is_equiv(answer, ground_truth) else 0.0


def last_boxed_only_string(text: str) -> str | None:
    r"""The last ``\boxed{...}`` (braces balanced), ``\boxed x`` (up to a ``$``) or ``\fbox{...}`` in ``text``."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start : position + 1]
    return None


def remove_boxed(boxed: str) -> str | None:
    r"""The content of ``\boxed{...}`` or ``\boxed x``; None for anything else."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{") : -1]
    return None


def is_equiv(first: str | None, second: str | None) -> bool:
    """Whether two answers are the same after normalisation (both missing counts as equal)."""
    if first is None or second is None:
        return first is None and second is None
    try:
        return strip_string(first) == strip_string(second)
    except ValueError:  # a form the normalisation does not handle: compare as written
        return first == second


def strip_string(answer: str) -> str:
    """The normalised form of a LaTeX answer (see the module docstring)."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        answer = answer.replace(old, new)
    answer = _drop_units(answer)
    answer = answer.replace("\\%", "")
    answer = answer.replace(" .", " 0.").replace("{.", "{0.")
    if not answer:
        return answer
    if answer.startswith("."):
        answer = "0" + answer
    sides = answer.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3": keep the value
        answer = sides[1]
    answer = _brace_sqrt(answer).replace(" ", "")
    answer = _brace_fracs(answer)
    if answer == "0.5":
        return "\\frac{1}{2}"
    return _slash_as_frac(answer)


def _drop_units(answer: str) -> str:
    r"""``3 \text{ cm}`` → ``3 ``: in MATH, ``\text{ `` with a space only ever introduces units (once)."""
    parts = answer.split("\\text{ ")
    if len(parts) > 2:
        raise ValueError("more than one unit")
    return parts[0]


def _brace_sqrt(answer: str) -> str:
    r"""``\sqrt3`` → ``\sqrt{3}``."""
    if answer.endswith("\\sqrt"):
        raise ValueError("a square root of nothing")
    return re.sub(r"\\sqrt([^{])", r"\\sqrt{\1}", answer)


def _brace_fracs(answer: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{72}`` → ``\frac{1}{72}``; a frac with fewer than two
    characters after it leaves the whole answer as it was."""
    pieces = answer.split("\\frac")
    rebuilt = pieces[0]
    for piece in pieces[1:]:
        rebuilt += "\\frac"
        if piece.startswith("{"):
            rebuilt += piece
        elif len(piece) < 2:
            return answer
        elif piece[1] == "{":
            rebuilt += "{" + piece[0] + "}" + piece[1:]
        else:
            rebuilt += "{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return rebuilt


def _slash_as_frac(answer: str) -> str:
    r"""``3/4`` → ``\frac{3}{4}`` for plain integers only."""
    match = re.fullmatch(r"(-?\d+)/(-?\d+)", answer)
    if not match or answer != f"{int(match[1])}/{int(match[2])}":
        return answer
    return "\\frac{" + str(int(match[1])) + "}{" + str(int(match[2])) + "}"
