"""The router between agent loops and rollout servers (``Router``; its parts are described in ``router.router``)."""

from agentloop.router.router import Router, RunningSample, ServerHung
from agentloop.router.stats import RouterStats

__all__ = ["Router", "RouterStats", "RunningSample", "ServerHung"]
