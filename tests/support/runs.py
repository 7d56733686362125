"""Command-line training runs stopped from outside, as a user or a scheduler stops them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def signal_at_checkpoint(command: list[str], env: dict[str, str], latest: Path, step: int, signum: int) -> tuple[int, str, float]:
    """Run ``command`` in a session of its own until ``latest`` (``latest_checkpointed_iteration.txt``) names
    checkpoint ``step``, then send ``signum`` to its process group; return its exit code, its output and the
    seconds it took to exit after the signal (killed if over 90)."""
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not (latest.exists() and latest.read_text() == str(step)):
            assert run.poll() is None, f"the run ended before its step-{step} checkpoint:\n{run.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no step-{step} checkpoint within 240 s"
            time.sleep(0.01)
        signalled = time.monotonic()
        os.killpg(run.pid, signum)
        output = run.communicate(timeout=90)[0]
        return run.returncode, output, time.monotonic() - signalled
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already when it ended or stopped
            os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
