"""``verifiers_agent``: a ``verifiers`` environment (Prime Intellect's environment hub) trained unedited.

Why the environment drives its own rollout: a verifiers environment owns its loop (``Environment.rollout``: its
``setup_state``, ``env_response``, ``@vf.stop`` conditions, ``get_prompt_messages`` overrides, tool calls, parser)
and asks an OpenAI client for each model turn. Re-driving it from ``env_agent`` through its hooks would re-implement
that loop and lose every override an environment makes; so each sample runs the environment's own ``rollout`` with an
``AsyncOpenAI`` client pointed at its session at the worker's gateway (``agentloop.gateway``), which records exactly
the tokens the engine sampled and the template's delta of every message the environment added (one trajectory, as
for ``external_agent``). The rollout runs on an event loop of its own thread (``run_in_own_thread``): an environment
that blocks (a sync tool, a slow ``env_response``) cannot stall the worker's loop, which serves the gateway too.

What maps to what:

- the environment: ``vf.load_environment(env_id, **env_args)`` (an installed environment package, or any importable
  module with ``load_environment``), from this loop's registry entry (``env_id``, ``env_args``) or the row's
  ``extra_info.verifiers`` (``{env_id, env_args}``); loaded once per worker process;
- a row is the environment's ``RolloutInput``: ``prompt``; ``answer`` from ``reward_model.ground_truth``; ``info`` and
  ``task`` from ``extra_info.verifiers`` (``task`` defaults to the row's ``data_source``); ``example_id`` from
  ``extra_info.index``. ``dataset_rows`` turns the environment's own dataset into such rows;
- the reward is its rubric's (``rubric.score_rollout``: every reward function, weighted; its metrics are the
  sample's ``reward_extra_info``); a trajectory step's ``reward`` that the environment sets (``add_trajectory_step``)
  is that turn's reward (``TurnRecord.env_reward``);
- single-turn, multi-turn and tool environments (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``,
  ``StatefulToolEnv``); tools are the gateway's (``multi_turn.format`` parses the calls);
- an error the rollout ends on (``state["error"]``: a ``vf.Error`` of the environment, a tool in ``stop_errors``, a
  model call refused) fails the sample with that error, as does one the environment raises, or a rollout past
  ``rollout.agent.external.timeout_s``; a rollout the session's token budget stopped keeps its trajectory (``length``)
  and is scored.

Not supported: ``message_type="completion"`` (the gateway serves chat), group reward functions (a rubric is scored
per sample; GRPO groups are the trainer's), ``interleaved_rollouts`` (prime-rl's token endpoint: the gateway already
keeps exact tokens), environment servers (``start_server``/``env_client``: the environment runs in the worker),
images, and ``EnvGroup`` routing by ``task`` beyond what its own ``rollout`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from typing import Any, Iterator

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.agent_loop.external_agent import ExternalAgentLoop, SessionGateway, run_in_own_thread
from agentloop.models.cache import cache_root
from agentloop.protocol import AgentLoopOutput
from agentloop.rows import write_rows_once

# (env_id, env_args as JSON) -> the loaded environment, one per worker process
_ENVIRONMENTS: dict[tuple[str, str], Any] = {}
_LOADING = threading.Lock()


def load_verifiers_env(env_id: str, env_args: dict[str, Any] | None = None) -> Any:
    """The environment ``vf.load_environment(env_id, **env_args)`` returns, loaded once per process.

    verifiers' ``Environment`` installs SIGINT/SIGTERM handlers when it is built (to run its teardown); in a worker
    those signals belong to Ray and agentloop, and outside the main thread ``signal.signal`` raises, so they are
    left out while it loads (its ``atexit`` teardown stays)."""
    key = (env_id, json.dumps(env_args or {}, sort_keys=True, default=str))
    with _LOADING:
        if key not in _ENVIRONMENTS:
            import verifiers as vf

            with _verifiers_signal_handlers_skipped():
                try:
                    _ENVIRONMENTS[key] = vf.load_environment(env_id, **(env_args or {}))
                except Exception as error:
                    raise ValueError(
                        f"verifiers environment {env_id!r} (env_args={env_args or {}}) cannot be loaded: "
                        f"{type(error).__name__}: {error}"
                    ) from error
        return _ENVIRONMENTS[key]


@contextlib.contextmanager
def _verifiers_signal_handlers_skipped() -> Iterator[None]:
    # only verifiers' module sees the stand-in: the process's own signal handling is untouched
    import verifiers.envs.environment as environment

    class NoHandlers:
        SIGINT, SIGTERM, default_int_handler = signal.SIGINT, signal.SIGTERM, signal.default_int_handler

        @staticmethod
        def signal(*_: Any) -> None:
            return None

    environment.signal = NoHandlers
    try:
        yield
    finally:
        environment.signal = signal


def rollout_input(row: dict[str, Any]) -> dict[str, Any]:
    """The verifiers ``RolloutInput`` of an agentloop row (see the module's docstring)."""
    extra_info = row.get("extra_info") or {}
    spec = extra_info.get("verifiers") or {}
    answer = (row.get("reward_model") or {}).get("ground_truth")
    example_id = extra_info.get("index", row.get("index"))
    return {
        "prompt": [dict(message) for message in row["prompt"]],
        "example_id": int(example_id) if example_id is not None else 0,
        "task": spec.get("task") or row.get("data_source") or "default",
        **({"answer": answer} if answer is not None else {}),
        **({"info": spec["info"]} if spec.get("info") is not None else {}),
    }


def dataset_rows(
    env_id: str, env_args: dict[str, Any] | None = None, n: int = -1, split: str = "train"
) -> list[dict[str, Any]]:
    """The environment's dataset (``split``: ``train`` or ``eval``) as agentloop rows for ``verifiers_agent``, at most
    ``n`` of them (-1: all): ``prompt`` (its system prompt and few-shot included), ``reward_model.ground_truth`` its
    ``answer``, ``extra_info.verifiers`` naming the environment with the row's ``task`` and ``info`` (as JSON)."""
    env = load_verifiers_env(env_id, env_args)
    dataset = env.get_dataset(n) if split == "train" else env.get_eval_dataset(n)
    rows = []
    for index, example in enumerate(dataset):
        info = example.get("info")
        rows.append(
            {
                "data_source": f"verifiers/{env_id}",
                "agent_name": "verifiers_agent",
                "prompt": list(example["prompt"]),
                "reward_model": {"ground_truth": example.get("answer")},
                "extra_info": {
                    "index": index,
                    "verifiers": {
                        "env_id": env_id,
                        **({"env_args": env_args} if env_args else {}),  # (parquet cannot hold an empty struct)
                        "task": example.get("task"),
                        "info": info if info is None or isinstance(info, str) else json.dumps(info),
                    },
                },
            }
        )
    return rows


def cached_dataset(env_id: str, split: str = "train", n: int = -1) -> str:
    """A cached parquet of ``dataset_rows(env_id, n=n, split=split)`` (the environment's default arguments), written
    on first use under ``$AGENTLOOP_CACHE/data/verifiers``; its path. A ``task.prepare`` step for ``data.train_files``
    / ``val_files`` (``config/verifiers_grpo.yaml``). It is keyed by the environment's id, the split and ``n`` only:
    delete it when the environment's dataset changes."""
    path = cache_root() / "data" / "verifiers" / env_id.replace("/", "--") / f"{split}-{n}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_rows_once(path, lambda: dataset_rows(env_id, n=int(n), split=split))


async def rollout_and_score(env: Any, base_url: str, api_key: str, row: dict[str, Any]) -> Any:
    """The environment's own rollout of the row against the session's base URL, scored by its rubric: its state."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        # no sampling args: the rollout's own hold at the gateway whatever a client asks
        state = await env.rollout(rollout_input(row), client, "agentloop", {})
        await env.rubric.score_rollout(state)
        return state
    finally:
        await client.close()


class VerifiersAgentLoop(ExternalAgentLoop):
    """One sample of a verifiers environment: its rollout through a gateway session, its rubric's reward.

    A registry entry may set ``env_id`` and ``env_args`` (else the row's ``extra_info.verifiers`` names them), and
    ``timeout_s`` or ``max_tokens_per_call`` (else ``rollout.agent.external``'s)."""

    def __init__(
        self,
        env_id: str | None = None,
        env_args: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        max_tokens_per_call: int | None = None,
        gateway: SessionGateway | None = None,
        **kwargs: Any,
    ) -> None:
        AgentLoopBase.__init__(self, **kwargs)  # (ExternalAgentLoop's own asks for a program; the env is the program)
        self.gateway = gateway  # the worker's: ExternalAgentLoop.run opens the session there
        settings = self.rollout.agent.external
        self.env_id, self.env_args = env_id, dict(env_args or {})
        self.timeout_s = float(timeout_s or settings.timeout_s)
        self.max_tokens_per_call = max_tokens_per_call or settings.get("max_tokens_per_call")
        self.state: Any = {}  # the rollout's verifiers State, once it returns

    def _environment(self, row: dict[str, Any]) -> Any:
        spec = (row.get("extra_info") or {}).get("verifiers") or {}
        env_id = self.env_id or spec.get("env_id")
        if not env_id:
            raise ValueError(
                "verifiers_agent needs an environment: set env_id in its agent loop entry "
                "(actor_rollout_ref.rollout.agent.agent_loop_config_path) or the row's extra_info.verifiers.env_id"
            )
        return load_verifiers_env(env_id, self.env_args if self.env_id else spec.get("env_args"))

    async def _run_agent(self, base_url: str, session: Any, row: dict[str, Any]) -> float | None:
        """Run the environment's rollout within ``timeout_s``; its rubric's reward (None: no rubric score)."""
        env = await asyncio.to_thread(self._environment, row)
        try:
            self.state = await asyncio.wait_for(
                run_in_own_thread(rollout_and_score, env, base_url, session.api_key, row), self.timeout_s
            )
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the verifiers environment's rollout ran past actor_rollout_ref.rollout.agent.external.timeout_s="
                f"{self.timeout_s:g}s after {session.calls} model call(s); it was stopped"
            ) from None
        error = self.state.get("error")
        if error is not None and session.end not in ("length", "context_length"):  # (the budget's stop is scored)
            raise RuntimeError(
                f"the verifiers environment's rollout ended on an error: {_error_chain(error)}"
            ) from error
        reward = self.state.get("reward")
        return None if reward is None else float(reward)

    async def _output(self, session: Any, row: dict[str, Any], returned: float | None) -> AgentLoopOutput:
        output = await super()._output(session, row, returned)
        if returned is not None:
            output.reward_extra_info = {
                f"verifiers/{k}": float(v) for k, v in (self.state.get("metrics") or {}).items()
            }
        steps = self.state.get("trajectory") or []
        for turn, step in zip(session.trajectory.turns, steps):
            turn.env_reward = float(step.get("reward") or 0.0)
        output.metrics["env_steps"] = float(len(steps))
        return output


def _error_chain(error: BaseException) -> str:
    """``Type: message`` of the error and of each cause under it (verifiers wraps a tool's or model's error)."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)
