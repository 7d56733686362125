"""Interactions (user simulators) that answer the model when it makes no tool call."""

from agentloop.interactions.base import BaseInteraction, load_interactions

__all__ = ["BaseInteraction", "load_interactions"]
