"""Interactions (user simulators) that answer the model when it makes no tool call."""

from agentloop.interactions.base import BaseInteraction, check_interaction_config, load_interactions

__all__ = ["BaseInteraction", "check_interaction_config", "load_interactions"]
