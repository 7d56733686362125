"""The running sample's judge and the record of its calls: what environments and interactions reach the judge by, below the router (``agentloop.judge.client`` holds the ``Judge`` itself).

The worker serves a judge for each sample's asyncio task (``serving``; ``agentloop.judge.client.judge_session``);
``current_judge()`` is that judge, and every call it makes for the sample is recorded there as a ``JudgeCall``.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class JudgeCall:
    """One call of the judge for a sample: the prompt and the reply (decoded; a reward model's score as text),
    their token counts, the seconds it took, and why it failed (None: it did not)."""

    prompt: str
    text: str
    prompt_tokens: int
    response_tokens: int
    latency_s: float
    error: str | None = None


class JudgeError(RuntimeError):
    """A judge call that failed; ``text`` is what the judge answered, if anything."""

    def __init__(self, message: str, text: str = "") -> None:
        super().__init__(f"{message}; the judge's text: {text!r}")
        self.text = text


class JudgeUnparsable(JudgeError):
    """A reply that a reader (``Judge.grade``) cannot turn into a grade."""

    def __init__(self, text: str, why: str) -> None:
        super().__init__(f"the judge's reply cannot be read ({why})", text)


# the worker's agentloop.judge.Judge (None: no judge is served) and the running sample's calls
_current: ContextVar[Any] = ContextVar("agentloop_judge", default=None)
_calls: ContextVar[list[JudgeCall] | None] = ContextVar("agentloop_judge_calls", default=None)


def current_judge() -> Any:
    """The ``agentloop.judge.Judge`` of the running sample, for its environments and interactions (the worker hands
    it to the reward step itself: ``agentloop.rewards.score_output``)."""
    judge = _current.get()
    if judge is None:
        raise RuntimeError("no judge is served: set reward_model.enable=true (and reward_model.model.path)")
    return judge


@contextlib.contextmanager
def serving(judge: Any, calls: list[JudgeCall] | None = None) -> Iterator[list[JudgeCall]]:
    """Within it, ``judge`` is the current judge (None: none); yields the list the calls are recorded in: ``calls``
    (a sample's, for a call made for it from another task: the judge's HTTP front), else a new one."""
    calls = [] if calls is None else calls
    tokens = _current.set(judge), _calls.set(calls)
    try:
        yield calls
    finally:
        _current.reset(tokens[0])
        _calls.reset(tokens[1])


def record(call: JudgeCall) -> None:
    """Add ``call`` to the running sample's calls (none outside a sample: a benchmark's direct calls)."""
    calls = _calls.get()
    if calls is not None:
        calls.append(call)


def last_call() -> JudgeCall | None:
    """The running sample's latest call, if any."""
    calls = _calls.get()
    return calls[-1] if calls else None
