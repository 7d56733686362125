"""Records for tools: OpenAI function schemas (validated with pydantic), parsed calls, tool responses."""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


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
    _as_written: dict[str, Any] | None = PrivateAttr(default=None)

    @classmethod
    def from_written(cls, written: dict[str, Any]) -> OpenAIFunctionToolSchema:
        """Validate a schema and keep it as written (a tool YAML's ``tool_schema``) for ``for_template``."""
        schema = cls.model_validate(written)
        schema._as_written = copy.deepcopy(written)
        return schema

    def for_template(self) -> dict[str, Any]:
        """The schema for a chat template's ``tools=``: as written when it was (``from_written``), else as built.

        Templates render a schema verbatim (``tool | tojson``), so the validated copy, with its defaults
        added (``description: ""``) and keys in the model's order, would make a different prompt than
        a chat client sending the same schema.
        """
        if self._as_written is not None:
            return copy.deepcopy(self._as_written)
        return self.model_dump(exclude_none=True)


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
