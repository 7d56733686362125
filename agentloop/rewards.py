"""The reward of a finished sample, computed as verl computes it, for every agent loop.

The rule, in order:

1. A loop that set ``AgentLoopOutput.reward_score`` itself keeps it (verl: e.g. an SWE agent that runs
   its own tests).
2. Otherwise the reward function for the row's ``data_source`` scores the whole response, decoded with
   ``skip_special_tokens=True`` (tool observations included, as verl decodes it; a trajectory whose context was
   rewritten: ``AgentLoopOutput.whole_response_ids``, each turn and observation once): the dotted path in
   ``custom_reward_function.by_data_source[data_source]``, else ``custom_reward_function.path`` (a
   ``.py`` file or ``pkg://module``) with ``.name`` and ``.reward_kwargs``; else, with a discriminative reward
   model (``reward_model.kind``), its score of the conversation (the row's prompt and the response as the
   assistant's message, decoded with its special tokens but the eos text: verl's DisRM, ``reward_model_text``); else
   the built-in scorer for the data source (``agentloop.reward_score``).
3. Otherwise the loop's own reward parts (``AgentLoopOutput.reward_parts``) add up: the tools'
   ``calc_reward``, the interaction's ``calculate_score`` and the environment's ``info["reward"]`` values (a
   task whose tools judge the answer, such as the quick start's). With no parts either, the reward is 0.

The parts are handed to the reward function by source in ``extra_info["rollout_reward_scores"]``
(``RewardParts.by_source``), with ``extra_info["num_turns"]``, so a function can combine them. Which rule
gave the reward is recorded in ``SampleScore.reward_source``. A function is ``fn(data_source,
solution_str, ground_truth, extra_info, **reward_kwargs) -> float | dict`` (a dict has the score under
``"score"``; every key goes to ``SampleScore.reward_extra_info``, and a plain float is recorded as
``acc``, as verl does), sync or ``async``. Sync functions run in a thread, off the
worker's event loop; every call is bounded by ``custom_reward_function.timeout_s``, past which the
sample fails (see ``rollout.max_failed_sample_ratio``). With ``reward_model.enable``, a function that takes them
(by name, or ``**kwargs``) is also given ``judge`` (``agentloop.judge.Judge``: an ``async`` function awaits its
calls, while the other samples' rollouts go on) and verl's GenRM arguments: ``reward_router_address`` (``host:port...``
of the judge's HTTP front, whose calls are the sample's, ``agentloop.judge.front``; None for a reward model) and
``reward_model_tokenizer`` (the judge's tokenizer).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

from hydra.utils import get_method

from agentloop.protocol import AgentLoopOutput, SampleScore
from agentloop.reward_score import default_compute_score, has_scorer
from agentloop.settings.reward import RewardSettings


# what a function that takes them (by name or **kwargs) is given with reward_model.enable (verl's GenRM arguments)
JUDGE_ARGUMENTS = ("judge", "reward_router_address", "reward_model_tokenizer")


@functools.lru_cache(maxsize=None)
def _load_dotted(path: str) -> Callable[..., Any]:
    try:
        return get_method(path)
    except Exception as error:
        raise ValueError(f"custom_reward_function.by_data_source: {path!r} cannot be imported: {error}") from error


@functools.lru_cache(maxsize=None)
def _load_named(path: str, name: str) -> Callable[..., Any]:
    """``name`` from a ``.py`` file (verl's convention) or from ``pkg://package.module``."""
    where = f"custom_reward_function.path={path!r}"
    if path.startswith("pkg://"):
        module = importlib.import_module(path[len("pkg://") :])
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"{where}: no such file; name a .py file or pkg://package.module")
        spec = importlib.util.spec_from_file_location(f"custom_reward_{abs(hash(str(file.resolve())))}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise AttributeError(f"{where} has no function custom_reward_function.name={name!r}")
    return getattr(module, name)


def reward_function_for(
    settings: RewardSettings, data_source: str | None, builtin: bool = True
) -> Callable[..., Any] | None:
    """The function that scores samples of ``data_source`` (rule 2 above), or None; the built-in scorers only with
    ``builtin``."""
    # a row without a data source (None: no key a config can name) falls to the next rule
    dotted = settings.by_data_source.get(data_source) if data_source is not None else None
    if dotted:
        return _load_dotted(dotted)
    if settings.path:
        function = _load_named(settings.path, settings.name)
        return functools.partial(function, **settings.reward_kwargs) if settings.reward_kwargs else function
    return default_compute_score if builtin and has_scorer(data_source) else None


async def judge_arguments(function: Callable[..., Any], judge: Any) -> dict[str, Any]:
    """``judge``, and verl's ``reward_router_address`` and ``reward_model_tokenizer``, for a function that takes them
    by name or ``**kwargs`` (none without a judge)."""
    if judge is None:
        return {}
    parameters = inspect.signature(function).parameters
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    wanted = [name for name in JUDGE_ARGUMENTS if takes_any or name in parameters]
    offered = {"judge": judge, "reward_model_tokenizer": judge.tokenizer}
    if "reward_router_address" in wanted:  # (the judge's HTTP front starts the first time an address is asked for)
        offered["reward_router_address"] = await judge.router_address()
    return {name: offered[name] for name in wanted}


async def call_reward_function(
    function: Callable[..., Any], timeout_s: float, **arguments: Any
) -> tuple[float, dict[str, Any]]:
    """Run a reward function off the event loop within ``timeout_s``; return ``(score, reward_extra_info)``."""
    target = function.func if isinstance(function, functools.partial) else function
    try:
        if inspect.iscoroutinefunction(target):
            result = await asyncio.wait_for(function(**arguments), timeout_s)
        else:
            # a thread cannot be stopped: past the timeout the sample fails and the call is left to finish
            result = await asyncio.wait_for(asyncio.to_thread(function, **arguments), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(
            f"reward function {getattr(target, '__qualname__', target)!r} took longer than "
            f"custom_reward_function.timeout_s={timeout_s:g}s"
        ) from None
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(
                f"reward function {getattr(target, '__qualname__', target)!r} returned a dict without 'score': {sorted(result)}"
            )
        return float(result["score"]), dict(result)
    return float(result), {"acc": float(result)}


def reward_model_text(tokenizer: Any, response: list[int]) -> str:
    """The response as a discriminative reward model reads it, as verl's reward loop builds it: decoded with its
    special tokens (a multi-turn response's observations keep their ``<|im_start|>`` and role), the eos text removed."""
    text = tokenizer.decode(response)
    return text.replace(tokenizer.eos_token, "") if tokenizer.eos_token else text


async def score_output(
    settings: RewardSettings,
    tokenizer: Any,
    row: dict[str, Any],
    output: AgentLoopOutput,
    judge: Any = None,
) -> SampleScore:
    """Set ``output.reward_score`` for a finished sample, by the rule in this module's docstring (``settings``:
    ``custom_reward_function``'s), and return where it came from (and, from a reward function, what it returned;
    from the loop, the loop's ``reward_extra_info``). ``judge``: the worker's ``agentloop.judge.Judge``
    (``reward_model.enable``; None: no judge). A reward function scores ``output.solution_str`` when the loop set
    it (``external_agent``: the program's final assistant message), else the decoded response."""
    parts = output.reward_parts.by_source()
    if output.reward_score is not None:
        return SampleScore("agent_loop", dict(output.reward_extra_info))
    reward_model = judge is not None and judge.kind == "discriminative"
    function = reward_function_for(settings, row.get("data_source"), builtin=not reward_model)
    # every turn and observation once, each segment's response cut to the batch's response length as the batch holds it
    response = output.whole_response_ids(settings.response_length)
    if function is None and reward_model:
        conversation = [*row["prompt"], {"role": "assistant", "content": reward_model_text(tokenizer, response)}]
        output.reward_score = await judge.score(conversation)
        return SampleScore("reward_model")
    if function is None:
        output.reward_score = sum(parts.values()) if parts else None
        return SampleScore("reward_parts" if parts else "none")
    solution = output.solution_str
    score, extras = await call_reward_function(
        function,
        settings.timeout_s,
        data_source=row.get("data_source"),
        solution_str=tokenizer.decode(response, skip_special_tokens=True) if solution is None else solution,
        ground_truth=(row.get("reward_model") or {}).get("ground_truth"),
        extra_info={**(row.get("extra_info") or {}), "num_turns": output.num_turns, "rollout_reward_scores": parts},
        **await judge_arguments(function, judge),
    )
    output.reward_score = score
    return SampleScore("reward_function", extras)
