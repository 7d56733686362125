"""The record of a sample's judge calls, below the router (``agentloop.judge.client`` holds the ``Judge`` itself).

The judge is handed to whatever uses it (reward functions, environments, interactions: ``require_judge``); which
sample a call is made for is the running asyncio task's: the worker records the calls of each sample's task
(``recording``; ``agentloop.judge.client.judge_session``), each as a ``JudgeCall``.
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


# the running sample's judge calls
_calls: ContextVar[list[JudgeCall] | None] = ContextVar("agentloop_judge_calls", default=None)


def require_judge(judge: Any) -> Any:
    """``judge`` (the worker's ``agentloop.judge.Judge``, handed to an environment or interaction by its loop), or an
    error saying how to serve one when it is None."""
    if judge is None:
        raise RuntimeError("no judge is served: set reward_model.enable=true (and reward_model.model.path)")
    return judge


@contextlib.contextmanager
def recording(calls: list[JudgeCall] | None = None) -> Iterator[list[JudgeCall]]:
    """Within it, the judge calls of this task are recorded in the list it yields: ``calls`` (a sample's, for a call
    made for it from another task: the judge's HTTP front), else a new one."""
    calls = [] if calls is None else calls
    token = _calls.set(calls)
    try:
        yield calls
    finally:
        _calls.reset(token)


def record(call: JudgeCall) -> None:
    """Add ``call`` to the running sample's calls (none outside a sample: a benchmark's direct calls)."""
    calls = _calls.get()
    if calls is not None:
        calls.append(call)


def last_call() -> JudgeCall | None:
    """The running sample's latest call, if any."""
    calls = _calls.get()
    return calls[-1] if calls else None
