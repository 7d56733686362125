"""Inference servers that run in processes of their own and are driven over HTTP (engines ``sglang`` and ``vllm``).

What the two share: the child process a server actor launches (its log in a file, its health awaited within
``rollout.server_startup_timeout_s``, stopped with the actor) and a JSON client whose connection pool belongs to
the event loop that opened it (an ``aiohttp`` session is bound to its loop), so a turn pays for no new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import aiohttp

PR_SET_PDEATHSIG = 1  # prctl(2)


class InFlightCalls:
    """Each session's calls in flight on a server, by the id each call gets (``<session>#<n>``: a server refuses an
    id already in flight, and one session may have several calls in flight). Calls in flight while a weight update
    pauses generation are marked: the server answers them ``abort``, which for them means ``interrupted``."""

    def __init__(self) -> None:
        self._by_session: dict[str, set[str]] = defaultdict(set)
        self._counter = itertools.count()
        self._pausing = False
        self._interrupted: set[str] = set()

    @contextlib.contextmanager
    def call(self, session: str) -> Iterator[str]:
        """A new call of ``session``, in flight while the block runs; yields its id."""
        call_id = f"{session}#{next(self._counter)}"
        self._by_session[session].add(call_id)
        if self._pausing:
            self._interrupted.add(call_id)
        try:
            yield call_id
        finally:
            self._interrupted.discard(call_id)
            self._by_session[session].discard(call_id)
            if not self._by_session[session]:
                del self._by_session[session]

    def of(self, session: str) -> list[str]:
        return list(self._by_session.get(session, ()))

    def __len__(self) -> int:
        return sum(len(calls) for calls in self._by_session.values())

    def interrupted(self, call_id: str) -> bool:
        return call_id in self._interrupted

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """While generation is paused for a weight update: the calls in flight now, and any started meanwhile, are
        interrupted ones."""
        self._pausing = True
        self._interrupted.update(call for calls in self._by_session.values() for call in calls)
        try:
            yield
        finally:
            self._pausing = False


class ServerProcess:
    """A server's child process (or none, when the engine attaches to a running server by URL)."""

    def __init__(self, name: str, url: str, headers: Mapping[str, str]) -> None:
        self.name = name  # "SGLang", "vLLM": how errors name the server
        self.url = url
        self.headers = dict(headers)
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def launch(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        """Start ``command`` with its output in a log file of its own."""
        self.log_path = Path(tempfile.mkstemp(prefix=f"{self.name.lower()}-", suffix=".log")[1])
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                preexec_fn=_die_with_parent,
                start_new_session=True,  # its own process group: terminate() reaches the processes it starts too
            )

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log: attached to an external server)"
        with open(self.log_path, errors="replace") as log:
            return "".join(deque(log, maxlen=lines))

    def wait_until_healthy(self, health_path: str, timeout_s: float) -> None:
        """Poll ``health_path`` until it answers 200; fail with the log's tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        request = urllib.request.Request(self.url + health_path, headers=self.headers)
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} server exited with code {self.process.returncode} during start-up; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(
                    f"{self.name} server at {self.url} not healthy after {timeout_s:.0f}s "
                    f"(actor_rollout_ref.rollout.server_startup_timeout_s); log tail:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def post_json(self, path: str, body: Any, timeout_s: float = 60.0) -> Any:
        """One blocking call, for start-up (before the actor's event loop serves): the answer's JSON."""
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={**self.headers, "Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{self.name} {path} answered {error.code}: {error.read().decode()[:500]}") from error
        return json.loads(text) if text else None

    def terminate(self) -> None:
        """Stop a launched server and every process it started (an attached one keeps running): a server that died
        on its own may have left its engine's processes behind in its group."""
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        deadline = time.monotonic() + 10  # its engine's processes stop after it, given a moment
        while live_processes_in_group(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)


def live_processes_in_group(group: int) -> list[int]:
    """The processes of a process group that still run (zombies left out), read from /proc (Linux; elsewhere none
    are found)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # a process that exits as we read it
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(process_group) == group and state != "Z":
                members.append(int(stat.parent.name))
    return members


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM when the process that launched it dies (Linux). A server actor that Ray
    kills, or a job whose Ray shuts down, gets no chance to stop its server, which would otherwise live on, holding
    its memory (and its GPU), under init."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class JSONClient:
    """POSTs JSON to one server; each call's errors name the server and the route."""

    def __init__(self, name: str, url: str, headers: Mapping[str, str], timeout_s: float) -> None:
        self.name = name
        self.url = url
        self.headers = dict(headers)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
            self._loop = loop
        return self._session

    async def post(
        self, path: str, body: Any = None, accept: tuple[int, ...] = (200,), params: Mapping[str, str] | None = None
    ) -> Any:
        """The answer's JSON (None for an empty body, the text of a plain-text one such as vLLM's LoRA routes give);
        any status outside ``accept`` raises with the server's text."""
        async with self.session().post(self.url + path, json=body, params=params) as response:
            text = await response.text()
            if response.status not in accept:
                raise RuntimeError(f"{self.name} {path} answered {response.status}: {text[:500]}")
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text

    async def close(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
