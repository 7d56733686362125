"""Long-lived MCP sessions against a real stdio server process: reuse, concurrency, death, hang, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil
import pytest

from agentloop.tools.mcp import MCPServerClient
from agentloop.tools.schemas import ToolCall
from agentloop.tools.toolset import load_tool_set
from tests.test_mcp_tools import tools_yaml_writer


@pytest.fixture(scope="module")
def mcp_tools_yaml(tmp_path_factory):
    return tools_yaml_writer(tmp_path_factory.mktemp("mcp-sessions"))


def call(tool_set, name: str, **arguments):
    return tool_set.call(ToolCall(name=name, arguments=arguments), "t", {}, {})


async def server_pid(tool_set) -> int:
    result = await call(tool_set, "pid")
    assert result.error is None, result.text
    return int(result.text)


def assert_gone(pids: set[int], within_s: float = 10.0) -> None:
    """Every pid exited and was reaped (a zombie still exists to psutil)."""
    deadline = time.monotonic() + within_s
    while (alive := {pid for pid in pids if psutil.pid_exists(pid)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, {pid: psutil.Process(pid).status() for pid in alive}


def test_calls_share_one_process_and_shutdown_leaves_none(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "reuse.yaml"))

    async def run():
        pids = {await server_pid(tool_set) for _ in range(5)}
        pids |= {int(r.text) for r in await asyncio.gather(*(call(tool_set, "pid") for _ in range(8)))}
        start = time.perf_counter()
        for _ in range(10):
            assert (await call(tool_set, "add", a=1, b=2)).text == "3"
        return pids, (time.perf_counter() - start) / 10

    pids, per_call_s = asyncio.run(run())
    assert len(pids) == 1
    assert per_call_s < 0.2  # a process start per call took ~1 s here
    assert_gone(pids)  # the loop ended: its session shut the server down

    second = asyncio.run(server_pid(tool_set))  # a new loop gets a session of its own
    assert second not in pids
    assert_gone({second})


def test_parallel_calls_run_concurrently_up_to_max_concurrency(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "bounded.yaml", max_concurrency=4, rate_limit=None))
    server = tool_set.tools["slow"].server

    async def run():
        await server_pid(tool_set)  # started: the timing below is the calls only
        start = time.perf_counter()
        results = await asyncio.gather(*(server.call_tool("slow", {"seconds": 0.5}) for _ in range(8)))
        return [json.loads(r.content[0].text) for r in results], time.perf_counter() - start

    results, wall_s = asyncio.run(run())
    assert len({r["pid"] for r in results}) == 1
    assert max(r["peak"] for r in results) == 4  # never more than max_concurrency at once ...
    assert 0.95 < wall_s < 1.9  # ... and that many at once: two waves of 0.5 s, not eight


def test_a_killed_server_fails_the_call_in_flight_and_restarts(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "killed.yaml"))

    async def run():
        first = await server_pid(tool_set)
        in_flight = asyncio.ensure_future(call(tool_set, "slow", seconds=20))
        await asyncio.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        failed = await asyncio.wait_for(in_flight, 5)
        return first, failed, await server_pid(tool_set)

    first, failed, second = asyncio.run(run())
    assert failed.error == "exception"
    assert "MCP server 'arith' was lost during the call: its process exited" in failed.text
    assert second != first
    assert_gone({first, second})


def test_a_slow_call_times_out_without_blocking_others_or_restarting(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "slow.yaml", timeout_s=1.5))

    async def run():
        first = await server_pid(tool_set)
        slow = asyncio.ensure_future(call(tool_set, "slow", seconds=60))
        quick = [await call(tool_set, "add", a=2, b=2) for _ in range(3)]  # served while `slow` hangs
        timed_out = await slow
        await asyncio.sleep(2.0)  # the probe after the timeout has answered by now
        return first, quick, timed_out, await server_pid(tool_set)

    first, quick, timed_out, after = asyncio.run(run())
    assert [r.text for r in quick] == ["4"] * 3
    assert timed_out.error == "timeout"
    assert after == first  # the server still answered: no restart


def test_a_hung_server_is_restarted_and_the_calls_in_flight_fail(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "hung.yaml", timeout_s=1.5, ping_timeout_s=1.0))

    async def run():
        first = await server_pid(tool_set)
        other = asyncio.ensure_future(call(tool_set, "slow", seconds=60))
        await asyncio.sleep(0.2)
        frozen = await call(tool_set, "freeze")  # SIGSTOP: the process answers nothing any more
        await asyncio.sleep(1.5)  # the probe gives up after 1 s
        return first, frozen, await other, await server_pid(tool_set)

    start = time.perf_counter()
    first, frozen, other, second = asyncio.run(run())
    assert frozen.error == "timeout"
    assert other.error in ("timeout", "exception")  # in flight when the server hung: failed either way
    assert second != first
    assert_gone({first, second})
    assert time.perf_counter() - start < 15


def test_a_server_that_cannot_start_fails_calls_with_the_cause():
    client = MCPServerClient("ghost", {"command": "/nonexistent/mcp-server"}, {"timeout_s": 5})

    async def run():
        errors = []
        for _ in range(2):
            try:
                await client.call_tool("anything", {})
            except Exception as error:  # noqa: BLE001
                errors.append(str(error))
        return errors

    first, second = asyncio.run(run())
    assert "MCP server 'ghost' could not be started" in first and "mcp-server" in first
    assert "next attempt in" in second  # backing off: no new process per call
