"""Tools for tool-calling agent loops: base class, schemas, YAML loading, call parsers, built-ins."""

from agentloop.tools.base_tool import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolCall, ToolResponse

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolCall", "ToolResponse"]
