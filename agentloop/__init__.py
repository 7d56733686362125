"""agentloop: multi-turn, tool-using rollouts as Ray services, feeding an FSDP PPO/GRPO trainer."""

from agentloop import config as _config  # noqa: F401  (registers the config resolvers)
from agentloop.agent_loop.base import AgentLoopBase
from agentloop.manager import AgentLoopManager
from agentloop.protocol import AgentLoopOutput, TokenOutput
from agentloop.registry import register

__all__ = ["AgentLoopBase", "AgentLoopManager", "AgentLoopOutput", "TokenOutput", "register"]
