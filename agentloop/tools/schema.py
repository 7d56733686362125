"""Records for tools: OpenAI function schemas (validated with pydantic), parsed calls, tool responses."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionParameters(BaseModel):
    """JSON Schema of a function's arguments: an object with named properties."""

    model_config = ConfigDict(extra="allow")
    type: Literal["object"] = "object"
    properties: dict[str, dict[str, Any]] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str = ""
    parameters: FunctionParameters = Field(default_factory=FunctionParameters)
    strict: bool | None = None


class OpenAIFunctionToolSchema(BaseModel):
    """``{"type": "function", "function": {name, description, parameters}}`` as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionSchema


class ToolCall(BaseModel):
    """One call parsed from model text; ``error`` is set when the call could not be parsed."""

    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None


class ToolResponse(BaseModel):
    """What a tool returns to the model. Only ``text`` is rendered by text-only chat templates."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    text: str | None = None
    image: Any = None
    video: Any = None
