"""``external_agent``: train an agent program that was not written for agentloop (OpenAI SDK, Agents SDK,
LangGraph...). Each sample gets a session at its worker's gateway (``agentloop.gateway``, which the worker hands the
loop as ``gateway``), an OpenAI-compatible base URL whose calls are recorded as the sample's trajectory, and the
program runs against it:

- a function (``rollout.agent.external.function``, a dotted path): ``async def agent(base_url, api_key, row) ->
  float | None`` (or a plain ``def``), run in a thread of its own (``run_in_own_thread``); ``base_url`` is the
  OpenAI base URL (``.../v1``), the ``anthropic`` SDK's is ``base_url.removesuffix("/v1")``;
- or a command line (``rollout.agent.external.command``) run as a subprocess with ``OPENAI_BASE_URL`` and
  ``OPENAI_API_KEY`` set (and ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``) and the row as JSON on stdin and in
  ``AGENTLOOP_ROW``; what it returns is the last line of its stdout, when that is a number.

Its reward is what it returns; None (or no number) leaves it to the rule every sample is scored by
(``agentloop.rewards.score_output``, in the worker), a reward function scoring the final assistant message (the
output's ``solution_str``). The program is bounded by ``rollout.agent.external.timeout_s`` and killed when it runs
past it or the rollout stops; past the deadline, exiting non-zero, raising, or making no model call fails the
sample (a command's stderr tail is kept in the failure). Once the session's token budget is spent the gateway
refuses the next call and the trajectory ends with ``length`` (or ``context_length``), whatever the program does then.
A registry entry may set ``function``, ``command``, ``timeout_s`` or ``max_tokens_per_call`` for its loop alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shlex
import signal
import threading
from typing import Any, Callable, Protocol

from hydra.utils import get_method

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.protocol import AgentLoopOutput, EndReason

STDERR_TAIL_CHARS = 2000


def agent_program(function: str | None, command: str | None) -> Callable[..., Any] | None:
    """The program ``external_agent`` runs: the function ``function`` names, imported (None: the program is
    ``command``). ValueError unless exactly one of the two is set, or when the function cannot be imported."""
    if bool(function) == bool(command):
        raise ValueError(
            "external_agent needs exactly one of actor_rollout_ref.rollout.agent.external.function (the dotted path "
            "of `async def agent(base_url, api_key, row)`) and .command (a command line); "
            f"got function={function!r}, command={command!r}"
        )
    if not function:
        return None
    try:
        return get_method(str(function))
    except Exception as error:
        raise ValueError(
            f"actor_rollout_ref.rollout.agent.external.function={function!r} cannot be imported: {error}"
        ) from error


class SessionGateway(Protocol):
    """What the loop needs of its worker's gateway (``agentloop.gateway.Gateway``, a layer above the loops)."""

    async def start(self) -> None: ...

    def open(
        self, sampling_params: dict[str, Any], timeout_s: float, max_tokens_per_call: int | None, processor: Any = None
    ) -> Any: ...

    def base_url(self, session: Any) -> str: ...

    async def close(self, session: Any, end: str = "stop") -> None: ...


class ExternalAgentLoop(AgentLoopBase):
    """Runs a user's agent program against a session of ``gateway`` (its worker's); the session's calls are the
    trajectory."""

    def __init__(
        self,
        function: str | None = None,
        command: str | None = None,
        timeout_s: float | None = None,
        max_tokens_per_call: int | None = None,
        gateway: SessionGateway | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.gateway = gateway
        settings = self.rollout.agent.external
        self.function, self.command = function or settings.function, command or settings.command
        self.agent = agent_program(self.function, self.command)
        self.timeout_s = float(timeout_s or settings.timeout_s)
        self.max_tokens_per_call = max_tokens_per_call or settings.get("max_tokens_per_call")

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        gateway = self.gateway
        if gateway is None:
            raise ValueError(f"{type(self).__name__} needs gateway= (an agent-loop worker hands it its own)")
        await gateway.start()
        session = gateway.open(sampling_params, self.timeout_s, self.max_tokens_per_call, self.processor)
        base_url = gateway.base_url(session)
        try:
            returned = await self._run_agent(base_url, session, row)
        except Exception:
            if session.end in ("length", "context_length"):  # the budget stopped it: its trajectory stands
                returned = None
            else:
                raise
        finally:
            await gateway.close(session)
        return await self._output(session, row, returned)

    async def _run_agent(self, base_url: str, session: Any, row: dict[str, Any]) -> float | None:
        """Run the program to its end within ``timeout_s``; what it returned (None: nothing usable)."""
        try:
            if self.function:
                return _as_reward(
                    await asyncio.wait_for(self._call_function(base_url, session.api_key, row), self.timeout_s)
                )
            return await self._run_command(base_url, session.api_key, row)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the external agent ran past actor_rollout_ref.rollout.agent.external.timeout_s={self.timeout_s:g}s "
                f"after {session.calls} model call(s); it was stopped"
            ) from None

    async def _call_function(self, base_url: str, api_key: str, row: dict[str, Any]) -> Any:
        return await run_in_own_thread(self.agent, base_url, api_key, row)

    async def _run_command(self, base_url: str, api_key: str, row: dict[str, Any]) -> float | None:
        """The command in its own process group (killed whole on timeout or cancellation); its last stdout line."""
        row_json = json.dumps(row, default=lambda value: value.tolist() if hasattr(value, "tolist") else repr(value))
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            # the anthropic SDK appends /v1/messages to its base URL
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": api_key,
            "AGENTLOOP_ROW": row_json,
        }
        process = await asyncio.create_subprocess_exec(
            *shlex.split(self.command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(row_json.encode()), self.timeout_s)
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if process.returncode != 0:
            tail = stderr.decode(errors="replace")[-STDERR_TAIL_CHARS:]
            raise RuntimeError(
                f"the external agent command {self.command!r} exited with {process.returncode}; stderr tail:\n{tail}"
            )
        lines = stdout.decode(errors="replace").strip().splitlines()
        return _as_reward(lines[-1]) if lines else None

    async def _output(self, session: Any, row: dict[str, Any], returned: float | None) -> AgentLoopOutput:
        trajectory = session.trajectory
        if trajectory is None or not trajectory.turns:
            raise RuntimeError("the external agent made no model call through its session's base URL (OPENAI_BASE_URL)")
        end: EndReason = (
            session.end if session.end in ("length", "context_length", "aborted") else (session.last_turn_end or "stop")
        )
        turns = trajectory.turns
        output = trajectory.to_output(
            end_reason=end,
            metrics={
                "assistant_turns": float(len(turns)),
                "tool_calls": float(sum(turn.tool_calls for turn in turns)),
                "model_tokens": float(sum(turn.model_tokens for turn in turns)),
                "observation_tokens": float(sum(turn.observation_tokens for turn in turns)),
                "gateway_calls": float(session.calls),
            },
        )
        output.reward_score = returned
        # what the reward rule every sample is scored by reads when the program returned no reward: its final answer
        output.solution_str = session.conversation[-1].get("content") or ""
        return output


async def run_in_own_thread(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a thread of its own, an ``async def`` on an event loop of its own there.

    Agent programs do blocking work between calls (building an OpenAI client takes ~50 ms of CPU: its TLS context);
    on the worker's event loop, which serves every sample and the gateway, 64 of them at once stalled it past the
    clients' 5 s connect timeout. A thread each (not the default executor's few) also lets hundreds run at once.
    Cancelling the awaiting task cancels the coroutine in its loop; a plain function cannot be stopped, and is left
    to finish."""
    outer = asyncio.get_running_loop()
    result: asyncio.Future = outer.create_future()
    inner: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []

    def settle(value: Any, error: BaseException | None) -> None:
        if not result.done():
            result.set_result(value) if error is None else result.set_exception(error)

    def main() -> None:
        value, error = None, None
        try:
            if inspect.iscoroutinefunction(function):
                loop = asyncio.new_event_loop()
                task = loop.create_task(function(*args))
                inner.append((loop, task))
                try:
                    value = loop.run_until_complete(task)
                finally:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                    loop.close()
            else:
                value = function(*args)
        except asyncio.CancelledError:
            return
        except BaseException as raised:  # handed to the awaiting task
            error = raised
        with contextlib.suppress(RuntimeError):  # the worker's loop is gone: nobody awaits it any more
            outer.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=main, name="external-agent", daemon=True).start()
    try:
        return await result
    except asyncio.CancelledError:
        for loop, task in inner:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)
        raise


def _as_reward(value: Any) -> float | None:
    """A returned reward: a number (or a line of text holding one), else None."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
