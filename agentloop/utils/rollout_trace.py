"""``rollout_trace_op``, under the name verl's tools and agent loops import (``verl.utils.rollout_trace``).

verl's decorator reports each call to a tracing backend (weave or mlflow, chosen by
``actor_rollout_ref.rollout.trace.*``). agentloop has no such backend: those keys are accepted and ignored
(``config/verl_ignored.yaml``), and what a trace would show, every turn with its tool calls, arguments,
responses and latencies, is in the rollout dumps (``trainer.rollout_data_dir``) and the viewer instead. So
here the decorator is a pass-through: code written for verl imports and applies it unchanged, and the
decorated function is the function itself, with its signature, its async-ness and its behaviour.
"""

from __future__ import annotations

from typing import Callable, TypeVar

Function = TypeVar("Function", bound=Callable)


def rollout_trace_op(func: Function) -> Function:
    """Mark a method as a traced rollout operation, as in verl; here it returns ``func`` unchanged (see the module)."""
    return func
