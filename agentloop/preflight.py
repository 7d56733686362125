"""Checks of a job's rows against its config, run before any server or rank starts.

Everything a batch would otherwise meet mid-run: every row's ``agent_name`` registered, every LoRA adapter an agent
entry or row names among the policy's, the tool and
interaction YAMLs loadable (classes importable, schemas valid), every ``interaction_kwargs.name`` among
the configured interactions, an external agent's program named, and a reward for every data source.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from omegaconf import DictConfig

from agentloop.interactions import check_interaction_config
from agentloop.registry import BUILTIN_AGENT_LOOPS, check_adapter_names, check_agent_names, resolve_agent_loops
from agentloop.rewards import reward_function_for
from agentloop.rows import verl_row_fields
from agentloop.settings import AgentSettings, Section, reward_settings
from agentloop.settings.adapters import adapter_names
from agentloop.settings.judge import resolve_kind
from agentloop.tools.toolset import check_tool_config

logger = logging.getLogger(__name__)

# loops whose own reward parts (tool calc_reward, interaction score, env rewards) stand in when no reward
# function applies (agentloop.rewards, rule 3), or whose program returns the reward (external_agent; verifiers_agent:
# the environment's rubric)
LOOPS_WITH_REWARDS_OF_THEIR_OWN = {"tool_agent", "env_agent", "external_agent", "verifiers_agent"}


def check_job(config: DictConfig, rows: dict[str, list[dict[str, Any]]]) -> None:
    """Raise ``ValueError`` listing every problem the rows (by split name) would meet; warn about data
    sources that get no reward."""
    rollout = config.actor_rollout_ref.rollout
    problems: list[str] = []
    loops = resolve_agent_loops(rollout.agent.agent_loop_config_path)
    agent = Section(rollout.agent, "actor_rollout_ref.rollout.agent")
    default_loop = AgentSettings.from_section(agent, bool(rollout.multi_turn.get("enable"))).default_agent_loop
    used: set[str] = set()
    for split, split_rows in rows.items():
        names = {row.get("agent_name") or default_loop for row in split_rows}
        used |= names
        try:
            check_agent_names(names, loops)
        except KeyError as error:
            problems.append(f"{split} data: {error.args[0]}")
    adapters = adapter_names(Section(config.actor_rollout_ref, "actor_rollout_ref").sub("model"))
    problems += check_adapter_names([row for split_rows in rows.values() for row in split_rows], loops, adapters)
    if "external_agent" in used and loops.get("external_agent") == BUILTIN_AGENT_LOOPS["external_agent"]:
        problems += _external_agent_problems(rollout.agent.external)
    if rollout.multi_turn.tool_config_path:
        _collect(problems, check_tool_config, rollout.multi_turn.tool_config_path)
    interaction_path = rollout.multi_turn.interaction_config_path
    if interaction_path:
        interactions = _collect(problems, check_interaction_config, interaction_path)
        if interactions is not None:
            problems += _interaction_names(rows, interactions, interaction_path)
    if problems:
        raise ValueError("the job cannot start:\n  - " + "\n  - ".join(problems))
    _warn_unrewarded(config, rows, default_loop)


def _external_agent_problems(external: DictConfig) -> list[str]:
    """The built-in ``external_agent`` needs one program: an importable function or a command line."""
    # here, not at the top: its session gateway imports fastapi, a third of a second on every job's start-up path
    from agentloop.agent_loop.external_agent import agent_program

    try:
        agent_program(external.function, external.command)
    except ValueError as error:
        return [f"rows use external_agent: {error}"]
    return []


def _collect(problems: list[str], check: Any, path: str) -> Any:
    try:
        return check(path)
    except (ValueError, FileNotFoundError) as error:
        problems.append(str(error))
        return None


def _interaction_names(rows: dict[str, list[dict[str, Any]]], interactions: set[str], path: str) -> list[str]:
    """One problem per split and unknown name: rows whose interaction_kwargs name no configured interaction."""
    problems = []
    for split, split_rows in rows.items():
        unknown = Counter(
            kwargs.get("name")
            for kwargs in (verl_row_fields(row)["interaction_kwargs"] for row in split_rows)
            if kwargs and kwargs.get("name") not in interactions
        )
        for name, count in sorted(unknown.items(), key=str):
            problems.append(
                f"{split} data: {count} row(s) have interaction_kwargs.name={name!r}, not among the interactions "
                f"of {path}: {sorted(interactions)}"
            )
    return problems


def _warn_unrewarded(config: DictConfig, rows: dict[str, list[dict[str, Any]]], default_loop: str) -> None:
    """Data sources whose rows get no reward function and run a loop without reward parts of its own (none when a
    discriminative reward model scores every sample)."""
    judge = config.reward_model
    if judge.get("enable") and resolve_kind(judge.kind, judge.model.path or config.actor_rollout_ref.model.path) == (
        "discriminative"
    ):
        return
    rewards = reward_settings(config)
    unrewarded = sorted(
        {
            str(row.get("data_source"))
            for split_rows in rows.values()
            for row in split_rows
            if (row.get("agent_name") or default_loop) not in LOOPS_WITH_REWARDS_OF_THEIR_OWN
            and reward_function_for(rewards, row.get("data_source")) is None
        }
    )
    if unrewarded:
        logger.warning(
            "no reward function for data_source %s: unless their agent loop sets reward_score itself, these "
            "samples get no reward; name one with custom_reward_function.path/.name or .by_data_source",
            unrewarded,
        )
