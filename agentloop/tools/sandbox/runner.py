"""``run_sandboxed``: one program in a fresh sandbox, seen from the host.

A temporary working directory, the bootstrap process in its own session, stdout and stderr capped,
the wall timer, then the kill and the cleanup, which also run when the caller is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentloop.tools.sandbox.child import guard
from agentloop.tools.sandbox.limits import SandboxLimits
from agentloop.tools.sandbox.output import CappedOutput

CHILD_DIR = Path(guard.__file__).resolve().parent
LAUNCHER = f"import sys; sys.path.insert(0, {str(CHILD_DIR)!r}); import bootstrap; bootstrap.main()"
STOP_GRACE_S = 1.0  # after SIGTERM, the time the bootstrap gets to kill its init and report
READ_GRACE_S = 1.0  # after the kill, the time given to pipes still held by processes that escaped
# one thread each for numerical libraries: their pools would eat the process and address-space limits
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not start: a fault of the machine or the configuration, not the program's."""


@dataclass
class SandboxRun:
    """How one program ended, and what it printed."""

    stdout: str
    stderr: str
    dropped_bytes: int  # output beyond max_output_bytes, read and discarded
    wall_s: float
    timed_out: bool  # killed by the wall timer
    exit_code: int | None = None
    signal: int | None = None  # the signal that ended the program
    cpu_s: float | None = None
    layers: dict[str, str] = field(default_factory=dict)  # the isolation layers that were active, by concern


def sandbox_ids(user: str) -> tuple[int, int] | None:
    """(uid, gid) the program runs as when the host is root; None when it keeps the host's ids."""
    if os.geteuid() != 0 or not user:
        return None
    if str(user).isdigit():
        uid = int(user)
        with contextlib.suppress(KeyError):
            return uid, pwd.getpwuid(uid).pw_gid
        return uid, uid
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def remove_tree(path: str) -> None:
    """Delete a run's directory, even where the program took its own permissions away."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError:
        # chmod before os.walk lists a directory; links are skipped: chmod would follow them out
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for parent, directories, _ in os.walk(path):
            for name in directories:
                child = os.path.join(parent, name)
                if not os.path.islink(child):
                    with contextlib.suppress(OSError):
                        os.chmod(child, 0o700)
        shutil.rmtree(path, ignore_errors=True)


async def run_sandboxed(code: str, limits: SandboxLimits) -> SandboxRun:
    """Run ``code`` as ``main.py`` in a fresh sandbox; raises ``SandboxUnavailable`` only when the
    sandbox itself failed, never for what the program did."""
    root = os.path.realpath(limits.work_root or tempfile.gettempdir())
    workdir = tempfile.mkdtemp(prefix="python_exec-", dir=root)
    try:
        ids = sandbox_ids(limits.sandbox_user) if limits.os_isolation else None
        main = Path(workdir, "main.py")
        main.write_text(code, encoding="utf-8")
        if ids is not None:
            for path in (workdir, main):
                os.chown(path, *ids)
        return await _run(workdir, ids, limits)
    finally:
        remove_tree(workdir)


def _bootstrap_config(workdir: str, ids: tuple[int, int] | None, limits: SandboxLimits, status_fd: int) -> dict:
    return {
        "status_fd": status_fd,
        "workdir": workdir,
        "os_isolation": limits.os_isolation,
        "uid": ids[0] if ids else None,
        "gid": ids[1] if ids else None,
        "masked_dirs": [os.path.realpath(os.path.expanduser(path)) for path in limits.masked_dirs],
        "shm_dir": os.path.realpath("/dev/shm"),
        "limits": {
            "cpu_s": limits.cpu_time_s,
            "memory_mb": limits.memory_mb,
            "processes": limits.max_processes,
            "file_mb": limits.max_file_mb,
            "open_files": limits.max_open_files,
        },
        "env": {**BASE_ENV, "HOME": workdir, "TMPDIR": workdir},
    }


async def _run(workdir: str, ids: tuple[int, int] | None, limits: SandboxLimits) -> SandboxRun:
    status_read, status_write = os.pipe()
    config = _bootstrap_config(workdir, ids, limits, status_write)
    start = time.monotonic()
    try:
        process = await asyncio.create_subprocess_exec(
            limits.python or sys.executable,
            "-I",
            "-S",
            "-c",
            LAUNCHER,
            json.dumps(config),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=(status_write,),
            start_new_session=True,
            cwd=workdir,
            env=config["env"],
        )
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    output = CappedOutput(limits.max_output_bytes)
    readers = [
        asyncio.ensure_future(output.drain(stream, name))
        for stream, name in ((process.stdout, "stdout"), (process.stderr, "stderr"))
    ]
    timed_out = False
    try:
        try:
            await asyncio.wait_for(process.wait(), limits.wall_time_s)
        except asyncio.TimeoutError:
            timed_out = True
    finally:  # also on cancellation: nothing of the sandbox outlives the call
        await _stop(process)
        _, pending = await asyncio.wait(readers, timeout=READ_GRACE_S)
        for reader in pending:
            reader.cancel()
        status = _read_status(status_read)
        os.close(status_read)
    if "setup_error" in status:
        raise SandboxUnavailable(f"python_exec sandbox could not start: {status['setup_error']}")
    if "layers" not in status and not timed_out:
        raise SandboxUnavailable(
            f"python_exec sandbox ended before starting the program (code {process.returncode}): {output.text('stderr')[-800:]}"
        )
    return SandboxRun(
        stdout=output.text("stdout"),
        stderr=output.text("stderr"),
        dropped_bytes=output.dropped,
        wall_s=time.monotonic() - start,
        timed_out=timed_out,
        exit_code=status.get("exit_code"),
        signal=status.get("signal", status.get("init_signal")),
        cpu_s=status.get("cpu_s"),
        layers=status.get("layers", {}),
    )


async def _stop(process: asyncio.subprocess.Process) -> None:
    """End the sandbox: SIGTERM lets the bootstrap kill its init (and with it the pid namespace) and
    reap it; SIGKILL to the process group then takes whatever is left."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
    # Without a pid namespace the program's children are still in the group. A group id stays taken
    # while any member lives, so this reaches a stranger only if the id was freed and reused since.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


def _read_status(fd: int) -> dict:
    """The status lines the sandbox wrote, merged (later keys win); never blocks."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    status: dict = {}
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            status.update(json.loads(line))
    return status
