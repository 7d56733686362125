"""MCP tools: discovery and calls through a real stdio MCP server written here."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agentloop.tools.schemas import ToolCall
from agentloop.tools.toolset import load_tool_set

SERVER = Path(__file__).parent / "support" / "mcp_server.py"


def tools_yaml_writer(directory: Path):
    """``write(selected, name, **config)``: a tool YAML of every (or the selected) tool of the test server."""
    servers = {"mcpServers": {"arith": {"command": sys.executable, "args": [str(SERVER)]}}}
    (directory / "servers.json").write_text(json.dumps(servers))

    def write(selected: list[str] | None, name: str, **options) -> str:
        config = {
            "type": "mcp",
            "mcp_servers_config_path": str(directory / "servers.json"),
            "timeout_s": 30,
            "rate_limit": 20,
        }
        config.update(options)
        if selected:
            config["tool_selected_list"] = selected
        path = directory / name
        path.write_text(json.dumps({"tools": [{"class_name": "agentloop.tools.mcp.MCPTool", "config": config}]}))
        return str(path)

    return write


@pytest.fixture(scope="module")
def mcp_tools_yaml(tmp_path_factory):
    return tools_yaml_writer(tmp_path_factory.mktemp("mcp"))


def test_discovery_and_calls(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "all.yaml"))
    schemas = {schema["function"]["name"]: schema["function"] for schema in tool_set.schemas}
    assert {"add", "shout", "fail", "pid", "slow", "freeze"} == set(schemas)
    assert schemas["add"]["description"] == "Add two integers."
    assert schemas["add"]["parameters"]["required"] == ["a", "b"]

    async def calls():
        created: dict[str, asyncio.Future] = {}
        return await asyncio.gather(
            tool_set.call(ToolCall(name="add", arguments={"a": 2, "b": 3}), "t", created, {}),
            tool_set.call(ToolCall(name="shout", arguments={"text": "hi"}), "t", created, {}),
            tool_set.call(ToolCall(name="fail", arguments={"reason": "nope"}), "t", created, {}),
            tool_set.call(ToolCall(name="add", arguments={"a": "x"}), "t", created, {}),
        )

    added, shouted, failed, invalid = asyncio.run(calls())
    assert added.text == "5" and added.error is None and added.metrics == {"mcp_server": "arith"}
    assert shouted.text == "HI"
    assert failed.text.startswith("Error: ") and "fail" in failed.text
    assert invalid.error == "invalid_arguments"


def test_tool_selected_list(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(["shout"], "selected.yaml"))
    assert [schema["function"]["name"] for schema in tool_set.schemas] == ["shout"]
    with pytest.raises(ValueError, match=r"tool_selected_list names tools no MCP server offers: \['missing'\]"):
        load_tool_set(mcp_tools_yaml(["shout", "missing"], "missing.yaml"))
