"""``BaseTool``: the four-call life cycle every tool follows, one instance per trajectory."""

from __future__ import annotations

from typing import Any

from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """A tool the model can call. Subclass and override ``execute`` (and the others as needed).

    ``config`` is the tool's ``config`` mapping from the tool YAML; ``timeout_s`` and
    ``max_concurrency`` there bound every call. State per trajectory lives under ``instance_id``.
    ``tool_schema`` is the entry's ``tool_schema``; an entry without one takes the schema the class's
    ``get_openai_tool_schema()`` returns (as in verl). ``name`` is the schema's function name; a
    subclass may set it.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        schema = tool_schema or self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(
                f"{type(self).__name__} has no schema: give its tool YAML entry a tool_schema, or override get_openai_tool_schema()"
            )
        self.tool_schema = (
            schema if isinstance(schema, OpenAIFunctionToolSchema) else OpenAIFunctionToolSchema.from_written(schema)
        )
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The tool's OpenAI function schema (the YAML's ``tool_schema``, unless a subclass defines its own)."""
        return self.tool_schema

    async def create(self, instance_id: str, **create_kwargs: Any) -> str:
        """Start per-trajectory state (``create_kwargs`` come from the row's ``tools_kwargs``). verl's tools
        return ``(instance_id, ToolResponse)``; either return is accepted."""
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
