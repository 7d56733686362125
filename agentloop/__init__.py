"""agentloop: multi-turn, tool-using rollouts as Ray services, feeding an FSDP PPO/GRPO trainer."""

import importlib
import os
from typing import Any

# OpenMP (libgomp, which torch's CPU wheels use) keeps its idle threads spinning for about 3 ms after each parallel
# region unless told otherwise. A tiny model on CPU runs thousands of short regions a step, so its threads spin
# most of the time: alone they spend a core on it, and beside another busy process the spinning takes the
# cores from the very thread they wait for (the warm start ran 18x slower beside a second one, not 2x; see
# benchmarks/under_load.py). Waiting passively costs one wake-up per region instead. libgomp reads the setting
# once, when torch is first imported: set here, it reaches this process and the local Ray it starts (its
# workers inherit the environment). A value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from agentloop import config as _config  # noqa: F401  (registers the config resolvers)
from agentloop.protocol import AgentLoopOutput, TokenOutput

__all__ = ["AgentLoopBase", "AgentLoopManager", "AgentLoopOutput", "TokenOutput", "register"]

# Imported on first use: a rollout server's process needs none of them, and the manager alone pulls in
# TensorDict and with it torch's compiler, about two seconds of start-up in every process that imports it.
_ON_FIRST_USE = {
    "AgentLoopBase": "agentloop.agent_loop.base",
    "AgentLoopManager": "agentloop.manager",
    "register": "agentloop.registry",
}


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'agentloop' has no attribute {name!r}")
