"""The session gateway: base URLs speaking Chat Completions, Anthropic Messages and OpenAI Responses, whose calls become
exact-token trajectories (``external_agent``)."""

from agentloop.gateway.gateway import Gateway
from agentloop.gateway.session import Session, SessionLimits

__all__ = ["Gateway", "Session", "SessionLimits"]
