"""MCP tools (``config.type: mcp``): tools discovered from MCP servers, called through the ``mcp`` client.

The servers are listed in a JSON file (``config.mcp_servers_config_path``) in the common
``{"mcpServers": {name: {"command", "args", "env"} | {"url"}}}`` shape: stdio servers are launched as
subprocesses, URLs are reached over streamable HTTP. ``config.tool_selected_list`` keeps only the named
tools; ``config.rate_limit`` (calls per second) and ``config.timeout_s`` apply per server. A session is
opened per call, which keeps calls independent across event loops and processes at the price of a
connection (for stdio: a process start) per call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path
from typing import Any

from agentloop.tools.base import BaseTool
from agentloop.tools.schema import OpenAIFunctionToolSchema, ToolResponse


class MCPServerClient:
    """One MCP server: how to reach it, and its per-server rate limit and timeout."""

    def __init__(self, name: str, spec: dict[str, Any], rate_limit: float | None, timeout_s: float) -> None:
        from mcp import StdioServerParameters

        self.name = name
        if spec.get("url"):
            self.target: Any = spec["url"]
        elif spec.get("command"):
            self.target = StdioServerParameters(command=spec["command"], args=list(spec.get("args") or []), env=spec.get("env"))
        else:
            raise ValueError(f"mcpServers.{name}: needs 'command' (stdio) or 'url' (HTTP)")
        self.interval = 1.0 / rate_limit if rate_limit else 0.0
        self.timeout_s = timeout_s
        self._next_slot = 0.0
        self._lock: asyncio.Lock | None = None

    async def _wait_for_slot(self) -> None:
        if not self.interval:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            now = asyncio.get_running_loop().time()
            if self._next_slot > now:
                await asyncio.sleep(self._next_slot - now)
            self._next_slot = max(now, self._next_slot) + self.interval

    async def list_tools(self) -> list[Any]:
        from mcp import Client

        async with Client(self.target, read_timeout_seconds=self.timeout_s) as client:
            return list((await client.list_tools()).tools)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        from mcp import Client

        await self._wait_for_slot()

        async def call() -> Any:
            async with Client(self.target, read_timeout_seconds=self.timeout_s) as client:
                return await client.call_tool(name, arguments)

        return await asyncio.wait_for(call(), self.timeout_s)


class MCPTool(BaseTool):
    """A tool served by an MCP server. Override ``to_response`` to parse results differently."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema, server: MCPServerClient) -> None:
        super().__init__(config, tool_schema)
        self.server = server

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        result = await self.server.call_tool(self.name, parameters)
        return self.to_response(result), 0.0, {"mcp_server": self.server.name}

    def to_response(self, result: Any) -> ToolResponse:
        """Text blocks joined by newlines (structured content as JSON when there is no text)."""
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        text = "\n".join(texts) if texts else json.dumps(result.structured_content)
        return ToolResponse(text=f"Error: {text}" if result.is_error else text)


def discover_mcp_tools(cls: type[MCPTool], config: dict[str, Any], where: str) -> list[MCPTool]:
    """Ask every listed server for its tools (in a helper thread: the caller may be inside an event loop)."""
    path = config.get("mcp_servers_config_path")
    if not path or not Path(path).is_file():
        raise ValueError(f"{where}.config.mcp_servers_config_path = {path!r} is not a file")
    servers = (json.loads(Path(path).read_text()) or {}).get("mcpServers")
    if not isinstance(servers, dict) or not servers:
        raise ValueError(f"{path}: expected a non-empty 'mcpServers' mapping")
    timeout = float(config.get("timeout_s", 30))
    clients = [MCPServerClient(name, spec, config.get("rate_limit"), timeout) for name, spec in servers.items()]

    async def list_all() -> list[tuple[MCPServerClient, Any]]:
        listed = await asyncio.gather(*(client.list_tools() for client in clients))
        return [(client, tool) for client, tools in zip(clients, listed) for tool in tools]

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            found = pool.submit(asyncio.run, list_all()).result(timeout=timeout + 5)
        except Exception as error:
            raise RuntimeError(f"{where}: MCP tool discovery from {path} failed: {type(error).__name__}: {error}") from error
    selected = config.get("tool_selected_list")
    tools = []
    for client, tool in found:
        if selected and tool.name not in selected:
            continue
        schema = OpenAIFunctionToolSchema.model_validate(
            {"type": "function", "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema}}
        )
        tools.append(cls(config={"timeout_s": timeout, **config}, tool_schema=schema, server=client))
    missing = sorted(set(selected or []) - {tool.name for tool in tools})
    if missing:
        raise ValueError(f"{where}.config.tool_selected_list names tools no MCP server offers: {missing}")
    return tools
