"""``tool_agent``: generate → parse tool calls → run tools → observe → generate again.

When the model makes no tool call and the row names an interaction (``extra_info.interaction_kwargs
.name``), the interaction (a simulated user) answers as a user turn instead, until it terminates.
One trajectory is one session on one server (the router keeps it there). It ends when the model
answers without calling a tool and no interaction continues the conversation (``stop``), at ``multi_turn.max_assistant_turns`` /
``max_user_turns`` (``max_turns``), when the next turn or observation would not fit in
``rollout.response_length`` (``length``) or a rewritten context in ``rollout.max_model_len`` (``context_length``), when tool errors exceed ``multi_turn.tool_error_budget``
(``tool_error_budget``), or when the engine aborts the request (``aborted``; an observation the model
had not begun to answer is taken back). It never ends on an observation, so the reward sits on a model token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.agent_loop.trajectory import Trajectory
from agentloop.interactions import BaseInteraction, load_interactions
from agentloop.protocol import AgentLoopOutput, EndReason, RewardParts, ToolCallRecord, TurnRecord
from agentloop.rows import verl_row_fields
from agentloop.tools.parsers import get_parser
from agentloop.tools.reasoning import prompt_opens_reasoning, split_reasoning
from agentloop.tools.schemas import ToolCall
from agentloop.tools.toolset import ToolResult, load_tool_set

# Far more characters than any token spans: a window of limit x this many characters holds more than
# `limit` tokens (when it does not, the whole text is tokenized instead).
CHARS_PER_TOKEN_BOUND = 16


class ToolAgentLoop(AgentLoopBase):
    """Multi-turn tool calling with exact tokens; observation tokens get loss mask 0."""

    def __init__(self, judge: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.judge = judge  # the worker's (reward_model.enable), for the interactions
        self.multi_turn = self.rollout.multi_turn
        self.tool_set = load_tool_set(self.multi_turn.tool_config_path)
        self.parse = get_parser(self.multi_turn.format)
        self.response_length = int(self.rollout.response_length)  # the budget of model turns and observations together

    def _interaction(self, kwargs: dict[str, Any]) -> BaseInteraction | None:
        # verl's preprocessing writes interaction_kwargs for tool-only jobs too: without an interaction
        # config they mean nothing (the trainer checks every row's name against the config before it starts)
        if not kwargs or not self.multi_turn.interaction_config_path:
            return None
        available = load_interactions(self.multi_turn.interaction_config_path, self.judge)
        if kwargs.get("name") not in available:
            raise KeyError(
                f"interaction_kwargs.name={kwargs.get('name')!r} is not among the interactions of "
                f"multi_turn.interaction_config_path: {sorted(available)}"
            )
        return available[kwargs["name"]]

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        session = await self._start(row)
        try:
            reason = await self._roll_out(session, sampling_params)
        finally:
            reward_parts = await self._finish(session)
        trajectory = session.trajectory
        mismatches = trajectory.sanity_check(self.multi_turn.tokenization_sanity_check_mode)
        # the reward is the worker's (agentloop.rewards): the row's reward function, else these parts
        return trajectory.to_output(
            end_reason=reason, reward_parts=reward_parts, metrics=self._metrics(trajectory.turns, mismatches)
        )

    async def _start(self, row: dict[str, Any]) -> _Session:
        """The row's trajectory (its prompt with the tools' schemas), and its interaction started, if it names one."""
        # top-level as verl's dataset passes them; rows handed to run() directly may keep them in extra_info
        verl_fields = verl_row_fields(row)
        create_kwargs = {
            name: (spec or {}).get("create_kwargs", {}) for name, spec in verl_fields["tools_kwargs"].items()
        }
        trajectory = self.start_trajectory(row, self.tool_set.schemas or None)
        interaction_kwargs = dict(verl_fields["interaction_kwargs"])
        interaction = self._interaction(interaction_kwargs)
        if interaction is not None:
            await interaction.start_interaction(row["request_id"], **interaction_kwargs)
        return _Session(row["request_id"], trajectory, create_kwargs, interaction, interaction_kwargs)

    async def _roll_out(self, session: _Session, sampling_params: dict[str, Any]) -> EndReason:
        """Model turns, each answered by its tool calls or else the interaction, until one of them ends the trajectory."""
        trajectory = session.trajectory
        while True:
            # Qwen3's thinking template opens the reasoning in the generation prompt: the turn starts inside it
            opened = prompt_opens_reasoning(self.tokenizer, trajectory.ids)
            _, text, end = await trajectory.generate_turn(
                self.server_manager, session.request_id, sampling_params, self.response_length
            )
            if end is not None:
                return end
            _, calls = self.parse(split_reasoning(text, opened=opened).content)
            if not calls and session.interaction is None:
                return "stop"
            if self._turn_limit_reached(trajectory):
                return "max_turns"
            end = await (self._run_tools(session, calls) if calls else self._ask_interaction(session))
            if end is not None:
                return end

    def _turn_limit_reached(self, trajectory: Trajectory) -> bool:
        max_assistant, max_user = self.multi_turn.max_assistant_turns, self.multi_turn.max_user_turns
        return bool(
            (max_assistant and len(trajectory.turns) >= max_assistant)
            or (max_user and len(trajectory.observation_roles) >= max_user)
        )

    async def _ask_interaction(self, session: _Session) -> EndReason | None:
        """The interaction answers the model's turn as a user turn: ``stop`` when it ends the conversation."""
        trajectory = session.trajectory
        done, reply, turn_score, _ = await session.interaction.generate_response(
            session.request_id, trajectory.messages, **session.interaction_kwargs
        )
        trajectory.turns[-1].interaction_score = float(turn_score)
        if done:
            return "stop"
        return self._observe(trajectory, [{"role": "user", "content": reply}])

    async def _run_tools(self, session: _Session, calls: list[ToolCall]) -> EndReason | None:
        """Run the turn's calls (up to ``max_parallel_calls``, in parallel) and show the model their results."""
        max_calls = int(self.multi_turn.max_parallel_calls)
        calls, dropped = calls[:max_calls], calls[max_calls:]
        results: list[ToolResult] = await asyncio.gather(
            *(self.tool_set.call(call, session.request_id, session.created, session.create_kwargs) for call in calls)
        )
        # Calls past the limit are not run, but the model made them: each is a counted fault, and
        # one tool message (not one per call: a turn can hold hundreds) tells the model.
        notice = ToolResult(
            f"Error: {len(dropped)} more tool call(s) were not run: at most {max_calls} run per turn",
            error="too_many_calls",
        )
        turns = session.trajectory.turns
        turns[-1].calls = [
            ToolCallRecord(call.name, call.arguments, result.text, result.latency_s, result.error)
            for call, result in zip(calls + dropped, results + [notice] * len(dropped))
        ]
        turns[-1].dropped_calls = len(dropped)
        turns[-1].step_reward = sum(result.step_reward for result in results)
        error_budget = self.multi_turn.tool_error_budget
        if error_budget is not None and sum(turn.tool_errors for turn in turns) > int(error_budget):
            return "tool_error_budget"
        shown = results + ([notice] if dropped else [])
        return self._observe(
            session.trajectory, [{"role": "tool", "content": r.content(self._truncate(r.text))} for r in shown]
        )

    def _observe(self, trajectory: Trajectory, messages: list[dict[str, Any]]) -> EndReason | None:
        """Append the observation, or end the trajectory (``length``, ``context_length``) when no model turn would
        fit after it."""
        return (
            None
            if trajectory.add_observation_within(messages, self.response_length) is not None
            else trajectory.overflow
        )

    async def _finish(self, session: _Session) -> RewardParts:
        """Release the trajectory's tools and interaction; what they scored it."""
        tool_rewards = await self.tool_set.finish(session.request_id, session.created)
        interaction_score = None
        if session.interaction is not None:
            interaction_score = float(
                await session.interaction.calculate_score(session.request_id, **session.interaction_kwargs)
            )
            await session.interaction.finalize_interaction(session.request_id, **session.interaction_kwargs)
        return RewardParts(tools=tool_rewards, interaction=interaction_score)

    def _truncate(self, text: str) -> str:
        """Cut a tool response to ``max_tool_response_length`` tokens on ``tool_response_truncate_side``."""
        limit = self.multi_turn.max_tool_response_length
        if not limit:
            return text
        # Tokenizing a megabyte takes about a second, and this loop shares its worker's event loop with
        # every other trajectory there: of a long text only the ends that can be kept are tokenized.
        window = limit * CHARS_PER_TOKEN_BOUND
        if len(text) > 2 * window:
            head = self.tokenizer.encode(text[:window], add_special_tokens=False)
            tail = self.tokenizer.encode(text[-window:], add_special_tokens=False)
            if len(head) > limit and len(tail) > limit:  # else tokens are unusually long: tokenize it all
                return self._cut(text, head, tail, limit)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= limit else self._cut(text, ids, ids, limit)

    def _cut(self, text: str, head: list[int], tail: list[int], limit: int) -> str:
        """The text cut to ``limit`` tokens; ``head`` and ``tail`` are the ids of its start and end (or of all of it)."""
        side = self.multi_turn.tool_response_truncate_side
        if side == "left":
            return "...(truncated)" + self._whole_characters(text, tail[-limit:], at_end=True)
        if side == "right":
            return self._whole_characters(text, head[:limit], at_end=False) + "...(truncated)"
        if side == "middle":
            return (
                self._whole_characters(text, head[: limit // 2], at_end=False)
                + "...(truncated)..."
                + self._whole_characters(text, tail[len(tail) - (limit - limit // 2) :], at_end=True)
            )
        raise ValueError(f"multi_turn.tool_response_truncate_side={side!r}; choose left, right or middle")

    def _whole_characters(self, text: str, ids: list[int], at_end: bool) -> str:
        """Decode ids kept from one end of ``text``, less the tokens at the cut that hold part of a character.

        Byte-level tokens can split a character (up to 4 bytes); decoded alone, its part becomes U+FFFD,
        which is not the tool's text and re-encodes to more tokens than the limit allowed for.
        """
        for drop in range(4):
            decoded = self.tokenizer.decode(ids[drop:] if at_end else ids[: len(ids) - drop])
            if text.endswith(decoded) if at_end else text.startswith(decoded):
                return decoded
        return self.tokenizer.decode(ids)  # a tokenizer whose decoding is not byte-exact: keep what it gives

    @staticmethod
    def _metrics(turns: list[TurnRecord], mismatches: int) -> dict[str, float]:
        latencies = [turn.tool_latency_s for turn in turns if turn.tool_calls]
        return {
            "assistant_turns": float(len(turns)),
            "tool_calls": float(sum(turn.tool_calls for turn in turns)),
            "tool_errors": float(sum(turn.tool_errors for turn in turns)),
            "tool_latency_s_mean": sum(latencies) / len(latencies) if latencies else 0.0,
            "tool_latency_s_max": max(latencies, default=0.0),
            "model_tokens": float(sum(turn.model_tokens for turn in turns)),
            "observation_tokens": float(sum(turn.observation_tokens for turn in turns)),
            "tokenization_mismatch": float(mismatches),
        }


@dataclass
class _Session:
    """One trajectory's rollout: its request, its trajectory, the tools' create kwargs and the instances created so
    far, and its interaction (None without one) with the row's interaction kwargs."""

    request_id: str
    trajectory: Trajectory
    create_kwargs: dict[str, Any]
    interaction: BaseInteraction | None
    interaction_kwargs: dict[str, Any]
    created: dict[str, asyncio.Future] = field(default_factory=dict)
