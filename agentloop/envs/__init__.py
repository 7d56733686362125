"""Environments for ``env_agent``: ``reset()``, ``step(response_text)``, ``format_observation(observation)``."""

from agentloop.envs.base import BaseEnv

__all__ = ["BaseEnv"]
