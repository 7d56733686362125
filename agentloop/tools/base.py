"""``BaseTool``: the four-call life cycle every tool follows, one instance per trajectory."""

from __future__ import annotations

from typing import Any

from agentloop.tools.schema import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """A tool the model can call. Subclass and override ``execute`` (and the others as needed).

    ``config`` is the tool's ``config`` mapping from the tool YAML; ``timeout_s`` and
    ``max_concurrency`` there bound every call. State per trajectory lives under ``instance_id``.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        self.config = dict(config)
        self.tool_schema = tool_schema

    @property
    def name(self) -> str:
        return self.tool_schema.function.name

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        """Start per-trajectory state (``create_kwargs`` come from the row's ``tools_kwargs``)."""
        return instance_id

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one call; return the response, a step reward and metrics."""
        raise NotImplementedError(f"{type(self).__name__} must implement execute()")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The trajectory-level reward this tool assigns (0.0 by default)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop per-trajectory state."""
