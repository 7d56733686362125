"""HTTP front of a rollout server: SGLang's native routes and OpenAI chat completions, served by uvicorn."""

from agentloop.server.http.app import build_app

__all__ = ["build_app"]
