"""Records for tools: OpenAI function schemas (validated with pydantic), parsed calls, tool responses.

verl's names (``verl.tools.schemas``) are all here; a property may be given as a dict (any JSON Schema)
or as an ``OpenAIFunctionPropertySchema``.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One argument's JSON Schema (``type``, ``description``, ``enum``, and any other JSON Schema key)."""

    model_config = ConfigDict(extra="allow")
    type: str
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """JSON Schema of a function's arguments: an object with named properties."""

    model_config = ConfigDict(extra="allow")
    type: Literal["object"] = "object"
    properties: dict[str, dict[str, Any]] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)

    @field_validator("properties", mode="before")
    @classmethod
    def _properties_as_dicts(cls, properties: Any) -> Any:
        if not isinstance(properties, dict):
            return properties
        return {
            name: value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
            for name, value in properties.items()
        }


class OpenAIFunctionSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool | None = None


class OpenAIFunctionToolSchema(BaseModel):
    """``{"type": "function", "function": {name, description, parameters}}`` as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema
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
    """What a tool returns to the model: ``text`` and, for a vision-language model, ``image`` (one image or a
    list: PIL images, bytes, paths or data URIs), shown to the model before the text."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    text: str | None = None
    image: Any = None
    video: Any = None


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the model wrote it: the function name and its arguments as a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with its arguments decoded."""

    name: str
    arguments: dict[str, Any]


class OpenAIFunctionToolCall(BaseModel):
    """A call in OpenAI's chat format."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema
