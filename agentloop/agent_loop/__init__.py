"""Agent loops: the base class, ``register`` and the built-ins (registered by name in ``agentloop.registry``).

verl's ``verl.experimental.agent_loop`` names are here: ``AgentLoopBase``, ``AgentLoopOutput``, ``register``.
"""

from agentloop.agent_loop.base import AgentLoopBase, DictConfigWrap, register
from agentloop.agent_loop.env_agent import EnvAgentLoop
from agentloop.agent_loop.single_turn import SingleTurnAgentLoop
from agentloop.agent_loop.tool_agent import ToolAgentLoop
from agentloop.protocol import AgentLoopOutput

__all__ = [
    "AgentLoopBase",
    "AgentLoopOutput",
    "DictConfigWrap",
    "EnvAgentLoop",
    "SingleTurnAgentLoop",
    "ToolAgentLoop",
    "register",
]
