"""Loading tools from YAML and running calls with timeouts, concurrency limits and argument checks.

Every fault a call can meet (unknown tool, unparsable call, arguments that fail the schema, a tool
that raises or times out) becomes an error text for the model and an error kind for metrics. Error
texts quote what the model sent only in bounded excerpts.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from pydantic import ValidationError

from agentloop.tools.base_tool import BaseTool
from agentloop.tools.parsers import valid_utf8
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolCall
from agentloop.yaml_entries import entry_class, read_entries


@dataclass
class ToolResult:
    """The outcome of one call, as the agent loop consumes it."""

    text: str
    step_reward: float = 0.0
    latency_s: float = 0.0
    # kind: unknown_tool | parse_error | invalid_arguments | exception | timeout; the agent loop adds
    # too_many_calls for calls past multi_turn.max_parallel_calls
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # a ToolResponse's ``image`` (one or a list), shown before the text

    def content(self, text: str) -> str | list[dict[str, Any]]:
        """The tool message's content: ``text`` alone, or the images then the text as content parts."""
        if not self.images:
            return text
        return [{"type": "image", "image": image} for image in self.images] + [{"type": "text", "text": text}]


class ToolSet:
    """The tools of one worker process; per-trajectory state lives in the tools under the instance id."""

    def __init__(self, tools: list[BaseTool]) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas, as chat templates take them in ``tools=`` (as written in the tool YAML)."""
        return [tool.tool_schema.for_template() for tool in self.tools.values()]

    async def call(
        self, call: ToolCall, instance_id: str, created: dict[str, asyncio.Future], create_kwargs: dict
    ) -> ToolResult:
        """Run one parsed call; never raises for faults of the call or the tool.

        ``created`` is the trajectory's record of tool instances: the first call of a tool starts its
        ``create`` and parallel calls of the same tool wait for that one creation.
        """
        result = await self._call(call, instance_id, created, create_kwargs)
        result.text = valid_utf8(result.text)  # a tool may return lone surrogates; the tokenizer would raise
        return result

    async def _call(
        self, call: ToolCall, instance_id: str, created: dict[str, asyncio.Future], create_kwargs: dict
    ) -> ToolResult:
        if call.error is not None:
            return ToolResult(f"Error: could not parse the tool call: {_excerpt(call.error)}", error="parse_error")
        tool = self.tools.get(call.name or "")
        if tool is None:
            return ToolResult(  # the name is the model's and may be a megabyte long
                f"Error: unknown tool {_excerpt(repr(call.name), 200)}; available tools: {sorted(self.tools)}",
                error="unknown_tool",
            )
        if tool.name not in self._validators:
            self._validators[tool.name] = argument_validator(
                tool.tool_schema.function.parameters.model_dump(exclude_none=True)
            )
        try:
            arguments = checked_arguments(call.arguments, self._validators[tool.name])
        except jsonschema.ValidationError as error:
            return ToolResult(
                f"Error: invalid arguments for {tool.name}: {_excerpt(error.message)}", error="invalid_arguments"
            )

        timeout = float(tool.config.get("timeout_s", 30))
        semaphore = self._semaphores.setdefault(
            tool.name, asyncio.Semaphore(int(tool.config.get("max_concurrency", 64)))
        )
        start = time.perf_counter()
        try:
            async with semaphore:
                if tool.name not in created:
                    created[tool.name] = asyncio.ensure_future(
                        tool.create(instance_id, **create_kwargs.get(tool.name, {}))
                    )
                await asyncio.wait_for(asyncio.shield(created[tool.name]), timeout)
                response, step_reward, metrics = await asyncio.wait_for(tool.execute(instance_id, arguments), timeout)
        except asyncio.TimeoutError:
            return ToolResult(
                f"Error: tool {tool.name} timed out after {timeout:g}s",
                latency_s=time.perf_counter() - start,
                error="timeout",
            )
        except Exception as error:  # a tool's bug is an observation for the model, not a crashed rollout
            return ToolResult(
                f"Error: tool {tool.name} failed: {type(error).__name__}: {_excerpt(str(error))}",
                latency_s=time.perf_counter() - start,
                error="exception",
            )
        images = (
            response.image
            if isinstance(response.image, list)
            else [response.image]
            if response.image is not None
            else []
        )
        return ToolResult(
            response.text or "", float(step_reward), time.perf_counter() - start, None, dict(metrics or {}), images
        )

    async def finish(self, instance_id: str, created: dict[str, asyncio.Future]) -> dict[str, float]:
        """Collect ``calc_reward`` from every tool this trajectory created, then release them."""
        rewards = {}
        for name in [
            name for name, done in created.items() if done.done() and not done.cancelled() and not done.exception()
        ]:
            tool = self.tools[name]
            timeout = float(tool.config.get("timeout_s", 30))
            try:
                rewards[name] = float(await asyncio.wait_for(tool.calc_reward(instance_id), timeout))
            finally:
                await asyncio.wait_for(tool.release(instance_id), timeout)
        return rewards


def argument_validator(parameters: dict[str, Any]) -> jsonschema.protocols.Validator:
    """The validator of a tool's arguments against its ``parameters`` schema, built once per tool: checking the
    schema against its meta-schema (as ``jsonschema.validate`` does on every call) costs more than validating."""
    cls = jsonschema.validators.validator_for(parameters)
    cls.check_schema(parameters)
    return cls(parameters)


def checked_arguments(arguments: dict[str, Any], validator: jsonschema.protocols.Validator) -> dict[str, Any]:
    """The arguments if they fit the schema; else with each top-level value that fails only by a lossless
    type converted (``105`` for a string is ``"105"``, ``"3"`` for an integer is ``3``, ``"true"`` for a
    boolean is ``True``). Raises the schema's error when conversion does not make them fit."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))  # the error jsonschema.validate raises
    if error is None:
        return arguments
    properties = validator.schema.get("properties") or {}
    converted = {name: _lossless(value, (properties.get(name) or {}).get("type")) for name, value in arguments.items()}
    if converted == arguments or jsonschema.exceptions.best_match(validator.iter_errors(converted)) is not None:
        raise error
    return converted


_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def _lossless(value: Any, wanted: Any) -> Any:
    """``value`` as JSON type ``wanted`` when the conversion loses nothing, else ``value`` unchanged."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if wanted == "string" and number:
        return str(value)
    if wanted == "integer" and isinstance(value, str) and _INTEGER.fullmatch(value):
        return int(value)
    if wanted == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if wanted == "number" and isinstance(value, str) and _NUMBER.fullmatch(value):
        return float(value) if any(mark in value for mark in ".eE") else int(value)
    if wanted == "boolean" and value in ("true", "false"):
        return value == "true"
    return value


def _excerpt(text: str, limit: int = 500) -> str:
    """At most ``limit`` characters of an error message.

    Messages quote what the model sent (jsonschema repeats the rejected value, a tool's exception its
    input) and the model may send a megabyte, which every record of the call (the trajectory's turns,
    rollout dumps) would then carry.
    """
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


@functools.lru_cache(maxsize=None)
def load_tool_set(path: str | None) -> ToolSet:
    """Build the tools listed in a YAML file (``tools: [{class_name, config, tool_schema}]``), once per process."""
    if not path:
        return ToolSet([])
    tools = []
    for where, entry in read_entries(path, "tools", "multi_turn.tool_config_path"):
        cls = entry_class(entry, where, BaseTool)
        config = entry.get("config") or {}
        if config.get("type") == "mcp":
            from agentloop.tools.mcp import MCPTool, discover_mcp_tools

            if not issubclass(cls, MCPTool):
                raise ValueError(
                    f"{where}.class_name: a tool with config.type mcp must subclass agentloop.tools.mcp.MCPTool"
                )
            tools += discover_mcp_tools(cls, config, where)
            continue
        schema = _entry_schema(entry, where, cls)
        try:
            tools.append(cls(config=config, tool_schema=schema))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from error
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{path}: tool names must be unique, repeated: {duplicates}")
    return ToolSet(tools)


def _entry_schema(entry: dict[str, Any], where: str, cls: type) -> OpenAIFunctionToolSchema | None:
    """The entry's validated ``tool_schema``; None when it has none and the class defines its own."""
    if entry.get("tool_schema") is None:
        if cls.get_openai_tool_schema is BaseTool.get_openai_tool_schema:
            raise ValueError(
                f"{where}: missing field 'tool_schema' ({cls.__qualname__} does not define get_openai_tool_schema())"
            )
        return None
    try:
        return OpenAIFunctionToolSchema.from_written(entry["tool_schema"])
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{where}.tool_schema.{location}: {first['msg']}") from error


def check_tool_config(path: str) -> list[str]:
    """Every tool's class importable and schema valid, without building the tools (MCP servers are not
    contacted); returns the declared tool names (an MCP entry counts as its server's tools, unnamed)."""
    names = []
    for where, entry in read_entries(path, "tools", "multi_turn.tool_config_path"):
        cls = entry_class(entry, where, BaseTool)
        if (entry.get("config") or {}).get("type") == "mcp":
            continue
        schema = _entry_schema(entry, where, cls)
        if schema is not None:
            names.append(schema.function.name)
    return names
