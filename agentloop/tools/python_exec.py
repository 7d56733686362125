"""``python_exec``: a code-interpreter tool that runs model-written Python in a sandbox (see ``agentloop.tools.sandbox``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import weakref
from typing import Any

from agentloop.tools.base_tool import BaseTool
from agentloop.tools.sandbox import SandboxLimits, SandboxRun, run_sandboxed
from agentloop.tools.sandbox.child import guard
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)

STARTUP_MARGIN_S = 5.0  # the ToolSet's timeout_s must leave the sandbox this long beyond wall_time_s


class PythonExecTool(BaseTool):
    """``python_exec(code)``: stdout (and stderr when not empty) of ``code`` run as ``main.py``.

    Every limit in ``SandboxLimits`` is set by name in the tool YAML's ``config``. The tool never raises
    for what the program does: an exception shows as its traceback, and a limit the program hits
    (wall or CPU time, memory, processes, file size, a refused write, network call or program start)
    comes back as text starting with ``Error:`` that names it, with ``{"sandbox_error": kind}`` in the
    metrics. Those are the program's outcome, like a traceback, so the ToolSet does not count them in
    ``tool_errors``; only a sandbox that cannot start raises (``SandboxUnavailable``, counted as
    ``exception``). At most ``max_sandboxes`` programs run at once per tool instance; waiting for a slot
    counts against ``timeout_s``, so keep ``max_sandboxes`` at least ``max_concurrency``.
    """

    layers_logged = False  # the active layers are logged once per process

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema) -> None:
        super().__init__(config, tool_schema)
        self.limits = SandboxLimits.from_config(self.config)
        timeout = float(self.config.get("timeout_s", 30))
        if timeout < self.limits.wall_time_s + STARTUP_MARGIN_S:
            raise ValueError(
                f"python_exec config: timeout_s ({timeout:g}) must be at least wall_time_s + {STARTUP_MARGIN_S:g} "
                f"({self.limits.wall_time_s + STARTUP_MARGIN_S:g}), or the ToolSet cuts runs before their own limit"
            )
        # one semaphore per event loop: an asyncio.Semaphore may only be awaited on one loop
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str):
            return (
                ToolResponse(text="Error: python_exec needs a string argument 'code'"),
                0.0,
                {"sandbox_error": "no_code"},
            )
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.limits.max_sandboxes))
        async with slots:
            run = await run_sandboxed(code, self.limits)
        if not PythonExecTool.layers_logged and run.layers:
            PythonExecTool.layers_logged = True
            logger.info(
                "python_exec sandbox layers: %s", "; ".join(f"{key}: {value}" for key, value in run.layers.items())
            )
        text, kind = describe(run, self.limits)
        metrics: dict[str, Any] = {
            "exit_code": run.exit_code,
            "wall_s": run.wall_s,
            "output_dropped_bytes": run.dropped_bytes,
        }
        if kind:
            metrics["sandbox_error"] = kind
        return ToolResponse(text=text), 0.0, metrics


def limit_hit(run: SandboxRun, limits: SandboxLimits) -> tuple[str, str] | None:
    """(kind, message) for the limit or refusal that ended the run, or None."""
    if run.timed_out:
        return "wall_time", f"python_exec killed after {limits.wall_time_s:g} s wall time"
    if run.signal == signal.SIGXCPU or (run.signal == signal.SIGKILL and (run.cpu_s or 0) >= limits.cpu_time_s):
        return "cpu_time", f"CPU time limit {limits.cpu_time_s:g} s exceeded"
    if run.signal is not None:
        return "signal", f"python_exec program killed by {signal.Signals(run.signal).name}"
    return {
        guard.EXIT_MEMORY: ("memory", f"memory limit {limits.memory_mb} MB exceeded (MemoryError)"),
        guard.EXIT_PROCESSES: ("processes", f"process limit {limits.max_processes} reached (fork or thread refused)"),
        guard.EXIT_FILE_SIZE: ("file_size", f"file size limit {limits.max_file_mb} MB exceeded"),
        guard.EXIT_REFUSED_NETWORK: ("network", "network access is disabled in python_exec"),
        guard.EXIT_REFUSED_WRITE: ("write", "writing outside the working directory is not allowed in python_exec"),
        guard.EXIT_REFUSED_EXEC: ("exec", "running other programs is not allowed in python_exec"),
        guard.EXIT_REFUSED_FORK: ("fork", "creating processes is not allowed in python_exec"),
    }.get(run.exit_code)


def describe(run: SandboxRun, limits: SandboxLimits) -> tuple[str, str | None]:
    """The model's observation of a run, and the kind of limit hit (None when none was)."""
    parts = []
    hit = limit_hit(run, limits)
    if hit:
        parts.append(f"Error: {hit[1]}")
    if run.stdout:
        parts.append(run.stdout.rstrip("\n"))
    if run.stderr:
        parts.append("[stderr]\n" + run.stderr.rstrip("\n"))
    if run.dropped_bytes:
        parts.append(f"[output cut at {limits.max_output_bytes} bytes; {run.dropped_bytes} more bytes dropped]")
    if not hit and run.exit_code:
        parts.append(f"[exit code {run.exit_code}]")
    return "\n".join(parts) if parts else "(no output)", hit[0] if hit else None
