"""Built-in agent loops; importing this package registers them."""

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.agent_loop.single_turn import SingleTurnAgentLoop

__all__ = ["AgentLoopBase", "SingleTurnAgentLoop"]
