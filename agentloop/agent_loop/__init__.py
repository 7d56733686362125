"""Agent loops: the base class and the built-ins (registered by name in ``agentloop.registry``)."""

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.agent_loop.env_agent import EnvAgentLoop
from agentloop.agent_loop.single_turn import SingleTurnAgentLoop
from agentloop.agent_loop.tool_agent import ToolAgentLoop

__all__ = ["AgentLoopBase", "EnvAgentLoop", "SingleTurnAgentLoop", "ToolAgentLoop"]
