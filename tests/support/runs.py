"""Command-line runs from the tests: stopped from outside, as a user or a scheduler stops them, or joining the
suite's Ray."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import ray


def joining_the_suite_ray() -> dict[str, str]:
    """The environment of a subprocess that joins this process's Ray through ``RAY_ADDRESS``, as a job ``ray job
    submit`` started does (a Ray of its own would cost about 10 CPU-seconds)."""
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def signal_at_checkpoint(
    command: list[str], env: dict[str, str], latest: Path, step: int, signum: int
) -> tuple[int, str, float]:
    """Run ``command`` in a session of its own until ``latest`` (``latest_checkpointed_iteration.txt``) names
    checkpoint ``step``, then send ``signum`` to its process group; return its exit code, its output (with a
    line marking where the signal was sent) and the seconds it took to exit after the signal (killed if over 90)."""
    with tempfile.TemporaryFile() as log, _interruptible_children():
        run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        try:
            while not (latest.exists() and latest.read_text() == str(step)):
                assert run.poll() is None, (
                    f"the run ended before its step-{step} checkpoint:\n{_read(log)[-3000:].decode(errors='replace')}"
                )
                assert time.monotonic() < deadline, f"no step-{step} checkpoint within 240 s"
                time.sleep(0.01)
            signalled = time.monotonic()
            os.killpg(run.pid, signum)
            sent_at = os.fstat(log.fileno()).st_size
            run.wait(timeout=90)
            stopped_s = time.monotonic() - signalled
            output = _read(log)
            before, after = output[:sent_at].decode(errors="replace"), output[sent_at:].decode(errors="replace")
            return (
                run.returncode,
                f"{before}\n<<< signal {signal.Signals(signum).name} sent here >>>\n{after}",
                stopped_s,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone already when it ended or stopped
                os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=30)


@contextlib.contextmanager
def _interruptible_children() -> Iterator[None]:
    """A process started in the background by a non-interactive shell (``pytest ... &``) ignores SIGINT, and its
    children inherit that: they would sit out a Ctrl-C. Children started inside this block get the default."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _read(log: Any) -> bytes:
    log.flush()
    log.seek(0)
    return log.read()
