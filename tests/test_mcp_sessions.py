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


async def started_server_pid(tool_set, within_s: float = 60.0) -> int:
    """The server's pid once it answers. A call to a server not yet running starts it, which on a busy machine can
    outlast a test's short call timeout; the start goes on after such a timeout and the next call waits for it."""
    deadline = time.monotonic() + within_s
    while (result := await call(tool_set, "pid")).error is not None:
        assert result.error == "timeout" and time.monotonic() < deadline, result.text
    return int(result.text)


async def until_gone(pids: set[int], within_s: float = 30.0) -> None:
    """``assert_gone`` inside the event loop that serves the calls (its sessions keep working meanwhile)."""
    deadline = time.monotonic() + within_s
    while {pid for pid in pids if psutil.pid_exists(pid)} and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert_gone(pids, within_s=0)


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
        for _ in range(10):
            assert (await call(tool_set, "add", a=1, b=2)).text == "3"
        return pids | {await server_pid(tool_set)}

    pids = asyncio.run(run())
    assert len(pids) == 1  # every call, before and after the others, was served by the one process
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
    assert max(r["peak"] for r in results) == 4  # that many at once, never more than max_concurrency ...
    assert wall_s >= 0.95  # ... so eight calls of 0.5 s took at least two waves


def test_a_killed_server_fails_the_call_in_flight_and_restarts(mcp_tools_yaml):
    tool_set = load_tool_set(mcp_tools_yaml(None, "killed.yaml"))

    async def run():
        first = await server_pid(tool_set)
        in_flight = asyncio.ensure_future(call(tool_set, "slow", seconds=20))
        await asyncio.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        failed = await asyncio.wait_for(in_flight, 15)  # before the call's own 20 s
        return first, failed, await server_pid(tool_set)

    first, failed, second = asyncio.run(run())
    assert failed.error == "exception"
    assert "MCP server 'arith' was lost during the call: its process exited" in failed.text
    assert second != first
    assert_gone({first, second})


def test_a_slow_call_times_out_without_blocking_others_or_restarting(mcp_tools_yaml):
    # a probe that answers in milliseconds gets 10 s, so a busy machine cannot make it fail
    tool_set = load_tool_set(mcp_tools_yaml(None, "slow.yaml", timeout_s=1.5, ping_timeout_s=10.0))

    async def run():
        first = await started_server_pid(tool_set)
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
        first = await started_server_pid(tool_set)
        other = asyncio.ensure_future(call(tool_set, "slow", seconds=60))
        await asyncio.sleep(0.2)
        frozen = await call(tool_set, "freeze")  # SIGSTOP: the process answers nothing any more
        await until_gone({first})  # the probe after the timeout got no answer: the server was retired and killed
        return first, frozen, await other, await started_server_pid(tool_set)

    first, frozen, other, second = asyncio.run(run())
    assert frozen.error == "timeout"
    assert other.error in ("timeout", "exception")  # in flight when the server hung: failed either way
    assert second != first
    assert_gone({first, second})


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
