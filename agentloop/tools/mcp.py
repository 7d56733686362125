"""MCP tools (``config.type: mcp``): tools discovered from MCP servers, called through the ``mcp`` client.

The servers are listed in a JSON file (``config.mcp_servers_config_path``) in the common
``{"mcpServers": {name: {"command", "args", "env"} | {"url"}}}`` shape: stdio servers are launched as
subprocesses, URLs are reached over streamable HTTP. ``config.tool_selected_list`` keeps only the named
tools; ``config.rate_limit`` (calls per second), ``config.timeout_s`` (per call) and
``config.max_concurrency`` (calls in flight, default 16) apply per server. Each server gets one
long-lived session per worker process (``agentloop.tools.mcp_session``), restarted when its process
dies or stops answering; ``config.ping_timeout_s`` (default min(5, timeout_s)) bounds the ping that
decides the latter and ``config.max_starts_per_minute`` (default 10) caps restarts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path
from typing import Any

from agentloop.tools.base_tool import BaseTool
from agentloop.tools.mcp_session import MCPSession
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class MCPServerClient:
    """One MCP server: how to reach it, and one long-lived ``MCPSession`` per event loop that calls it.

    A worker has one loop, so one session (one server process); several loops (tests, ``asyncio.run``
    in turn) get one each, and a session ends with its loop.
    """

    def __init__(self, name: str, spec: dict[str, Any], config: dict[str, Any]) -> None:
        from mcp import StdioServerParameters

        self.name = name
        if spec.get("url"):
            self.target: Any = spec["url"]
        elif spec.get("command"):
            self.target = StdioServerParameters(
                command=spec["command"], args=list(spec.get("args") or []), env=spec.get("env")
            )
        else:
            raise ValueError(f"mcpServers.{name}: needs 'command' (stdio) or 'url' (HTTP)")
        self.timeout_s = float(config.get("timeout_s", 30))
        self.session_options = {
            "max_concurrency": int(config.get("max_concurrency", 16)),
            "rate_limit": config.get("rate_limit"),
            "ping_timeout_s": config.get("ping_timeout_s"),
            "max_starts_per_minute": int(config.get("max_starts_per_minute", 10)),
        }
        self._sessions: dict[asyncio.AbstractEventLoop, MCPSession] = {}

    def session(self) -> MCPSession:
        """This loop's session (created on first use; sessions of closed loops are dropped)."""
        loop = asyncio.get_running_loop()
        for closed in [other for other in self._sessions if other.is_closed()]:
            del self._sessions[closed]
        if loop not in self._sessions:
            self._sessions[loop] = MCPSession(self.name, self.target, self.timeout_s, **self.session_options)
        return self._sessions[loop]

    async def list_tools(self) -> list[Any]:
        """The server's tools, over a connection of its own (discovery runs once, in a helper loop)."""
        from mcp import Client

        async with Client(self.target, read_timeout_seconds=self.timeout_s) as client:
            return list((await client.list_tools()).tools)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        return await self.session().call_tool(name, arguments)

    async def aclose(self) -> None:
        """Shut this loop's server process down (it would also end with the loop)."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


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
    clients = [MCPServerClient(name, spec, config) for name, spec in servers.items()]

    async def list_all() -> list[tuple[MCPServerClient, Any]]:
        listed = await asyncio.gather(*(client.list_tools() for client in clients))
        return [(client, tool) for client, tools in zip(clients, listed) for tool in tools]

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            found = pool.submit(asyncio.run, list_all()).result(timeout=timeout + 5)
        except Exception as error:
            raise RuntimeError(
                f"{where}: MCP tool discovery from {path} failed: {type(error).__name__}: {error}"
            ) from error
    selected = config.get("tool_selected_list")
    tools = []
    for client, tool in found:
        if selected and tool.name not in selected:
            continue
        schema = OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema},
            }
        )
        tools.append(cls(config={"timeout_s": timeout, **config}, tool_schema=schema, server=client))
    missing = sorted(set(selected or []) - {tool.name for tool in tools})
    if missing:
        raise ValueError(f"{where}.config.tool_selected_list names tools no MCP server offers: {missing}")
    return tools
