"""agentloop: multi-turn, tool-using rollouts as Ray services, feeding an FSDP PPO/GRPO trainer."""

import importlib
from typing import Any

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
