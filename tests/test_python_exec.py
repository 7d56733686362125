"""The python_exec sandbox with real processes: each misbehaving program is stopped or refused, the model
reads an error naming the cause, and the host is unaffected (no surviving process, no leftover directory)."""

from __future__ import annotations

import asyncio
import logging
import random
import select
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from agentloop.tools.python_exec import PythonExecTool
from agentloop.tools.sandbox import SandboxLimits, run_sandboxed
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolCall
from agentloop.tools.toolset import load_tool_set

REPO = Path(__file__).resolve().parent.parent
SCHEMA = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "python_exec",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
)
SMALL = {
    "timeout_s": 10,
    "wall_time_s": 3,
    "cpu_time_s": 1,
    "memory_mb": 256,
    "max_processes": 8,
    "max_output_bytes": 1000,
}


def sandbox_processes(work_root: Path) -> list[psutil.Process]:
    """Live processes of runs under ``work_root``: each carries its run's directory in its command line."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] != psutil.STATUS_ZOMBIE and str(work_root) in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


@pytest.fixture
def work_root(tmp_path):
    """The runs' parent directory; afterwards it must be empty and no sandbox process may be left."""
    yield tmp_path
    assert list(tmp_path.iterdir()) == [], "a run's working directory was not removed"
    assert psutil.Process().children(recursive=True) == []
    assert sandbox_processes(tmp_path) == [], "sandbox processes survived"
    assert subprocess.run(["true"], timeout=30).returncode == 0  # the host can still start processes


def make_tool(work_root: Path, **config) -> PythonExecTool:
    return PythonExecTool({**SMALL, "work_root": str(work_root), **config}, SCHEMA)


def run(tool: PythonExecTool, code: str) -> tuple[str, dict]:
    response, _, metrics = asyncio.run(tool.execute("trajectory", {"code": code}))
    return response.text, metrics


@pytest.fixture(scope="module")
def layers() -> dict[str, str]:
    """The layers this machine allows (the expectations below hold under each of them)."""
    return asyncio.run(run_sandboxed("pass", SandboxLimits.from_config({}))).layers


def test_ordinary_code_prints_its_result_and_layers_are_logged_once(work_root, caplog):
    tool = make_tool(work_root)
    PythonExecTool.layers_logged = False
    with caplog.at_level(logging.INFO, logger="agentloop.tools.python_exec"):
        text, metrics = run(tool, "print(sum(range(10)))")
        assert text == "45" and metrics["exit_code"] == 0 and "sandbox_error" not in metrics
        text, metrics = run(tool, "import sys\nprint('to stderr', file=sys.stderr)\nraise SystemExit(3)")
    assert text == "[stderr]\nto stderr\n[exit code 3]" and "sandbox_error" not in metrics
    assert [record.message.startswith("python_exec sandbox layers: namespaces: ") for record in caplog.records] == [
        True
    ]


def test_an_exception_is_a_traceback_not_an_error(work_root):
    text, metrics = run(make_tool(work_root), "def f():\n    return 1 / 0\nf()")
    assert text.startswith('[stderr]\nTraceback (most recent call last):\n  File "main.py", line 3')
    assert "ZeroDivisionError: division by zero" in text and "sandbox_error" not in metrics


def test_an_infinite_loop_hits_the_cpu_limit(work_root):
    # a wall limit far above one CPU second however busy the machine: the message says which limit ended it
    text, metrics = run(make_tool(work_root, wall_time_s=60, timeout_s=90), "while True: pass")
    assert text == "Error: CPU time limit 1 s exceeded" and metrics["sandbox_error"] == "cpu_time"


def test_a_sleeping_program_is_killed_at_the_wall_time(work_root):
    tool = make_tool(work_root, wall_time_s=5)  # far above the sandbox's start, however busy the machine

    async def watched_run():
        call = asyncio.ensure_future(
            tool.execute("trajectory", {"code": "import time\nprint('started')\ntime.sleep(60)"})
        )
        seen = 0
        while seen < 2 and not call.done():
            seen = len(sandbox_processes(work_root))
            await asyncio.sleep(0.05)
        assert seen >= 2  # the survivor check of the fixture can see them
        response, _, metrics = await call
        return response.text, metrics

    text, metrics = asyncio.run(watched_run())
    assert text == "Error: python_exec killed after 5 s wall time\nstarted" and metrics["sandbox_error"] == "wall_time"


def test_a_fork_bomb_hits_the_process_limit_and_nothing_survives(work_root, layers):
    text, metrics = run(make_tool(work_root), "import os\nwhile True:\n    os.fork()")
    if layers["processes"].startswith("RLIMIT_NPROC"):
        assert (
            text.startswith("Error: process limit 8 reached (fork or thread refused)")
            and metrics["sandbox_error"] == "processes"
        )
    else:  # root without namespaces: the audit hook refuses fork
        assert text.startswith("Error: creating processes is not allowed") and metrics["sandbox_error"] == "fork"
    # the fixture then checks that no process of the bomb is left


def test_too_many_threads_hit_the_process_limit(work_root, layers):
    if not layers["processes"].startswith("RLIMIT_NPROC"):
        pytest.skip(f"no process limit on this machine: {layers['processes']}")
    code = "import threading, time\nfor _ in range(20):\n    threading.Thread(target=time.sleep, args=(0.5,)).start()"
    text, metrics = run(make_tool(work_root), code)
    assert text.startswith("Error: process limit 8 reached") and "can't start new thread" in text


def test_a_huge_allocation_hits_the_memory_limit(work_root):
    text, metrics = run(make_tool(work_root), "x = bytearray(10**10)")
    assert text.startswith("Error: memory limit 256 MB exceeded (MemoryError)\n[stderr]\nTraceback")
    assert metrics["sandbox_error"] == "memory"


@pytest.mark.parametrize("where", ["tmp", "repo"])
def test_a_write_outside_its_directory_is_refused(work_root, where):
    target = (Path("/tmp") if where == "tmp" else REPO) / f"escape_{uuid.uuid4().hex}.txt"
    text, metrics = run(make_tool(work_root), f"open({str(target)!r}, 'w').write('x')")
    assert text.startswith("Error: writing outside the working directory is not allowed in python_exec")
    assert metrics["sandbox_error"] == "write" and not target.exists()


def test_files_inside_its_directory_work_and_are_size_limited(work_root):
    tool = make_tool(work_root, max_file_mb=1)
    code = (
        "open('a.txt', 'w').write('hi')\nimport os\nos.mkdir('d')\nprint(open('a.txt').read(), sorted(os.listdir('.')))"
    )
    assert run(tool, code)[0] == "hi ['a.txt', 'd', 'main.py']"
    text, metrics = run(tool, "open('big', 'wb').write(b'x' * 2 * 2**20)")
    assert text.startswith("Error: file size limit 1 MB exceeded") and metrics["sandbox_error"] == "file_size"


def test_a_network_connection_is_refused_and_never_arrives(work_root):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        text, metrics = run(
            make_tool(work_root), f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        )
        assert (
            text.startswith("Error: network access is disabled in python_exec")
            and metrics["sandbox_error"] == "network"
        )
        assert select.select([listener], [], [], 0.2)[0] == [], "the listener saw a connection"


def test_the_os_layers_hold_when_the_audit_hook_is_evaded(work_root, layers):
    """ctypes calls libc directly, past the hook: only the read-only mounts and the network namespace stop it."""
    if not layers["files"].startswith("read-only mounts") or not layers["network"].startswith("network namespace"):
        pytest.skip(f"no OS-level file or network isolation on this machine: {layers}")
    target = Path("/tmp") / f"escape_{uuid.uuid4().hex}.txt"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (
            "import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.open({str(target).encode()!r}, 0o101, 0o644), ctypes.get_errno())\n"
            f"address = struct.pack('=H', socket.AF_INET) + struct.pack('!H', {port}) + socket.inet_aton('127.0.0.1') + bytes(8)\n"
            "print(libc.connect(libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0), address, len(address)), ctypes.get_errno())"
        )
        text, _ = run(make_tool(work_root), code)
        assert text == "-1 30\n-1 101"  # EROFS, ENETUNREACH
        assert select.select([listener], [], [], 0.2)[0] == [], "the listener saw a connection"
    assert not target.exists()


def test_a_cancelled_call_leaves_nothing_behind(work_root):
    tool = make_tool(work_root, wall_time_s=120, timeout_s=130)

    async def cancelled_run():
        call = asyncio.ensure_future(tool.execute("trajectory", {"code": "import time\ntime.sleep(60)"}))
        await asyncio.sleep(0.8)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    start = time.monotonic()
    asyncio.run(cancelled_run())
    assert time.monotonic() - start < 60  # the cancel ended it, not the program's end or the wall limit
    # then the fixture checks for survivors and the directory


def test_running_another_program_is_refused(work_root):
    text, metrics = run(make_tool(work_root), "import subprocess\nsubprocess.run(['touch', '/tmp/x'])")
    assert (
        text.startswith("Error: running other programs is not allowed in python_exec")
        and metrics["sandbox_error"] == "exec"
    )


def test_huge_output_is_cut_at_the_limit_with_a_note(work_root):
    text, metrics = run(make_tool(work_root), "print('x' * 10**7)")
    dropped = 10**7 + 1 - 1000
    assert text == "x" * 1000 + f"\n[output cut at 1000 bytes; {dropped} more bytes dropped]"
    assert metrics["output_dropped_bytes"] == dropped and "sandbox_error" not in metrics


def test_parallel_calls_are_bounded_by_max_sandboxes(work_root):
    tool = make_tool(work_root, max_sandboxes=2)
    code = "import time\nstart = time.time()\ntime.sleep(0.6)\nprint(start, time.time())"

    async def six_calls():
        return await asyncio.gather(*(tool.execute("trajectory", {"code": code}) for _ in range(6)))

    spans = [tuple(map(float, response.text.split())) for response, _, _ in asyncio.run(six_calls())]
    edges = sorted(
        [(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda edge: (edge[0], edge[1])
    )
    running, most = 0, 0
    for _, step in edges:
        running += step
        most = max(most, running)
    assert most == 2


def test_the_audit_hook_alone_refuses_network_writes_and_programs(work_root):
    """With os_isolation off only rlimits and the hook remain; the hook still names what it refused."""
    tool = make_tool(work_root, os_isolation=False)
    target = Path("/tmp") / f"escape_{uuid.uuid4().hex}.txt"
    assert run(tool, f"open({str(target)!r}, 'a')")[1]["sandbox_error"] == "write" and not target.exists()
    assert run(tool, "import os\nos.rename('main.py', '/tmp/moved.py')")[1]["sandbox_error"] == "write"
    assert run(tool, "import socket\nsocket.socket().connect(('127.0.0.1', 9))")[1]["sandbox_error"] == "network"
    assert run(tool, "import os\nos.system('true')")[1]["sandbox_error"] == "exec"
    assert run(tool, "print(sum(range(10)))")[0] == "45"


def test_configuration_errors_name_the_key(work_root):
    with pytest.raises(ValueError, match=r"unknown keys \['wall_time'\]"):
        make_tool(work_root, wall_time=3)
    with pytest.raises(ValueError, match=r"timeout_s \(5\) must be at least wall_time_s \+ 5 \(8\)"):
        make_tool(work_root, timeout_s=5)
    with pytest.raises(ValueError, match="memory_mb must be positive"):
        make_tool(work_root, memory_mb=0)


def test_the_example_yaml_runs_through_the_toolset(work_root):
    tool_set = load_tool_set.__wrapped__(
        str(REPO / "config/tools/python_exec.yaml")
    )  # uncached: its tool is changed below
    assert [schema["function"]["name"] for schema in tool_set.schemas] == ["python_exec"]
    tool_set.tools["python_exec"].limits = SandboxLimits.from_config(
        {**tool_set.tools["python_exec"].config, "work_root": str(work_root)}
    )
    call = ToolCall(name="python_exec", arguments={"code": "print(6 * 7)"})
    result = asyncio.run(tool_set.call(call, "trajectory", {}, {}))
    assert (result.text, result.error) == ("42", None)
    missing = asyncio.run(tool_set.call(ToolCall(name="python_exec", arguments={}), "trajectory", {}, {}))
    assert missing.error == "invalid_arguments"


def test_arithmetic_python_task_runs_its_warm_start_programs_in_the_sandbox(model_path, tmp_path, monkeypatch):
    """The example task that trains with python_exec: its config composes, its rows ask for python_exec,
    and every program the warm start teaches runs in the real sandbox to the observation it was taught,
    which submit_answer then scores correct."""
    from agentloop.config import compose_config
    from agentloop.preparation import prepare
    from trainer.data import read_rows
    from agentloop.tasks.arithmetic.warm_start import conversation
    from agentloop.tools.parsers import parse_hermes
    from transformers import AutoTokenizer

    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path))
    config = compose_config(config_name="arithmetic_python_grpo")
    prepare(config, only=["train_data", "val_data"])
    rows = read_rows(config.data.train_files[0])
    assert len(rows) == 512 and "python_exec" in rows[0]["prompt"][0]["content"]
    tool_set = load_tool_set(config.actor_rollout_ref.rollout.multi_turn.tool_config_path)
    assert [schema["function"]["name"] for schema in tool_set.schemas] == ["python_exec", "submit_answer"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)  # the warm start's base: same tokenizer
    lengths = [
        len(
            tokenizer.apply_chat_template(
                row["prompt"], tools=tool_set.schemas, add_generation_prompt=True, return_dict=False
            )
        )
        for row in rows
    ]
    assert max(lengths) <= config.data.max_prompt_length, max(lengths)

    async def solve(row: dict) -> None:
        chat = conversation(row, True, random.Random(0), "python_exec")
        instance, created = f"row-{row['extra_info']['index']}", {}
        kwargs = {name: spec["create_kwargs"] for name, spec in row["extra_info"]["tools_kwargs"].items()}
        for message, reply in zip(chat[-5::2], chat[-4::2]):  # (assistant call, taught tool reply) pairs
            (call,) = parse_hermes(message["content"])[1]
            assert (await tool_set.call(call, instance, created, kwargs)).text == reply["content"]
        assert (await tool_set.finish(instance, created))["submit_answer"] == 1.0

    async def solve_all() -> None:
        await asyncio.gather(*(solve(row) for row in rows[:8]))

    asyncio.run(solve_all())
