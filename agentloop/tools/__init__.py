"""Tools for tool-calling agent loops: base class, schemas, YAML loading, call parsers, built-ins."""

from agentloop.tools.base import BaseTool
from agentloop.tools.schema import OpenAIFunctionToolSchema, ToolCall, ToolResponse

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolCall", "ToolResponse"]
