"""``tool_agent``: generate → parse tool calls → run tools → observe → generate again.

When the model makes no tool call and the row names an interaction (``extra_info.interaction_kwargs
.name``), the interaction (a simulated user) answers as a user turn instead, until it terminates.
One trajectory is one session on one server (the router keeps it there). It ends when the model
answers without calling a tool and no interaction continues the conversation (``stop``), at ``multi_turn.max_assistant_turns`` /
``max_user_turns`` (``max_turns``), when the next turn or observation would not fit in
``rollout.response_length`` (``length``), when tool errors exceed ``multi_turn.tool_error_budget``
(``tool_error_budget``), or when the engine aborts the request (``aborted``; an observation the model
had not begun to answer is taken back). It never ends on an observation, so the reward sits on a model token.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.interactions import BaseInteraction, load_interactions
from agentloop.protocol import AgentLoopOutput, EndReason
from agentloop.rows import verl_row_fields
from agentloop.tools.parsers import get_parser
from agentloop.tools.reasoning import prompt_opens_reasoning, split_reasoning
from agentloop.tools.toolset import ToolResult, load_tool_set

# Far more characters than any token spans: a window of limit x this many characters holds more than
# `limit` tokens (when it does not, the whole text is tokenized instead).
CHARS_PER_TOKEN_BOUND = 16


class ToolAgentLoop(AgentLoopBase):
    """Multi-turn tool calling with exact tokens; observation tokens get loss mask 0."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.multi_turn = self.rollout.multi_turn
        self.tool_set = load_tool_set(self.multi_turn.tool_config_path)
        self.parse = get_parser(self.multi_turn.format)

    def _interaction(self, kwargs: dict[str, Any]) -> BaseInteraction | None:
        # verl's preprocessing writes interaction_kwargs for tool-only jobs too: without an interaction
        # config they mean nothing (the trainer checks every row's name against the config before it starts)
        if not kwargs or not self.multi_turn.interaction_config_path:
            return None
        available = load_interactions(self.multi_turn.interaction_config_path)
        if kwargs.get("name") not in available:
            raise KeyError(
                f"interaction_kwargs.name={kwargs.get('name')!r} is not among the interactions of "
                f"multi_turn.interaction_config_path: {sorted(available)}"
            )
        return available[kwargs["name"]]

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        request_id = row["request_id"]
        # top-level as verl's dataset passes them; rows handed to run() directly may keep them in extra_info
        verl_fields = verl_row_fields(row)
        create_kwargs = {name: (spec or {}).get("create_kwargs", {}) for name, spec in verl_fields["tools_kwargs"].items()}
        tools = self.tool_set.schemas or None
        trajectory = self.start_trajectory(row, tools)
        budget = int(self.rollout.response_length)
        max_assistant = self.multi_turn.max_assistant_turns
        max_user = self.multi_turn.max_user_turns
        error_budget = self.multi_turn.tool_error_budget
        interaction_kwargs = dict(verl_fields["interaction_kwargs"])
        interaction = self._interaction(interaction_kwargs)
        if interaction is not None:
            await interaction.start_interaction(request_id, **interaction_kwargs)
        interaction_score = None
        turn_scores: list[float] = []
        created: dict[str, asyncio.Future] = {}
        turns: list[dict[str, Any]] = []
        errors_by_kind: dict[str, int] = {}
        assistant_turns = user_turns = 0
        reason: EndReason

        try:
            while True:
                # Qwen3's thinking template opens the reasoning in the generation prompt: the turn starts inside it
                opened = prompt_opens_reasoning(self.tokenizer, trajectory.ids)
                output, text, end = await trajectory.generate_turn(self.server_manager, request_id, sampling_params, budget)
                assistant_turns += 1
                turn = {"model_tokens": len(output.token_ids), "tool_calls": 0, "tool_errors": 0, "tool_latency_s": 0.0}
                turns.append(turn)
                if end is not None:
                    reason = end
                    # aborted before answering the last observation: that is gone (the empty turn stays on record,
                    # as the model turn that was asked for)
                    if trajectory.withdrawn is not None:
                        del turns[-2]["observation_tokens"]
                        user_turns -= 1
                    break
                _, calls = self.parse(split_reasoning(text, opened=opened).content)
                if not calls and interaction is None:
                    reason = "stop"
                    break
                if (max_assistant and assistant_turns >= max_assistant) or (max_user and user_turns >= max_user):
                    reason = "max_turns"
                    break
                if not calls:
                    done, reply, turn_score, _ = await interaction.generate_response(
                        request_id, trajectory.messages, **interaction_kwargs
                    )
                    turn_scores.append(float(turn_score))
                    turn["interaction_score"] = float(turn_score)
                    if done:
                        reason = "stop"
                        break
                    added = trajectory.add_observation_within([{"role": "user", "content": reply}], budget)
                    if added is None:
                        reason = "length"
                        break
                    turn["observation_tokens"] = added
                    user_turns += 1
                    continue
                max_calls = int(self.multi_turn.max_parallel_calls)
                calls, dropped = calls[:max_calls], calls[max_calls:]
                results: list[ToolResult] = await asyncio.gather(
                    *(self.tool_set.call(call, request_id, created, create_kwargs) for call in calls)
                )
                # Calls past the limit are not run, but the model made them: each is a counted fault, and
                # one tool message (not one per call: a turn can hold hundreds) tells the model.
                notice = ToolResult(
                    f"Error: {len(dropped)} more tool call(s) were not run: at most {max_calls} run per turn",
                    error="too_many_calls",
                )
                outcomes = results + [notice] * len(dropped)
                turn.update(
                    tool_calls=len(calls),
                    dropped_calls=len(dropped),
                    tool_errors=sum(result.error is not None for result in outcomes),
                    tool_latency_s=max((result.latency_s for result in results), default=0.0),
                    step_reward=sum(result.step_reward for result in results),
                    calls=[
                        {"name": call.name, "arguments": call.arguments, "result": result.text,
                         "latency_s": result.latency_s, "error": result.error}
                        for call, result in zip(calls + dropped, outcomes)
                    ],
                )
                for result in outcomes:
                    if result.error:
                        errors_by_kind[result.error] = errors_by_kind.get(result.error, 0) + 1
                if error_budget is not None and sum(errors_by_kind.values()) > int(error_budget):
                    reason = "tool_error_budget"
                    break
                shown = results + ([notice] if dropped else [])
                messages = [{"role": "tool", "content": result.content(self._truncate(result.text))} for result in shown]
                added = trajectory.add_observation_within(messages, budget)
                if added is None:
                    reason = "length"  # no room left for a model turn after this observation
                    break
                turn["observation_tokens"] = added
                user_turns += 1
        finally:
            tool_rewards = await self.tool_set.finish(request_id, created)
            if interaction is not None:
                interaction_score = float(await interaction.calculate_score(request_id, **interaction_kwargs))
                await interaction.finalize_interaction(request_id, **interaction_kwargs)

        mismatches = trajectory.sanity_check(self.multi_turn.tokenization_sanity_check_mode)
        # the reward is the worker's (agentloop.rewards): the row's reward function, else these parts
        return trajectory.to_output(
            num_turns=1 + assistant_turns + user_turns,  # the prompt counts as a turn, as in verl
            metrics=self._metrics(turns, errors_by_kind, mismatches),
            extra_fields={
                "finish_reason": reason,
                "turns": turns,
                "tool_rewards": tool_rewards,
                "tool_errors": errors_by_kind,
                "turn_scores": turn_scores,
                "interaction_score": interaction_score,
            },
        )

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
                self._whole_characters(text, head[: limit // 2], at_end=False) + "...(truncated)..."
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
    def _metrics(turns: list[dict[str, Any]], errors: dict[str, int], mismatches: int) -> dict[str, float]:
        calls = sum(turn["tool_calls"] for turn in turns)
        latencies = [turn["tool_latency_s"] for turn in turns if turn["tool_calls"]]
        return {
            "assistant_turns": float(len(turns)),
            "tool_calls": float(calls),
            "tool_errors": float(sum(errors.values())),
            "tool_latency_s_mean": sum(latencies) / len(latencies) if latencies else 0.0,
            "tool_latency_s_max": max(latencies, default=0.0),
            "model_tokens": float(sum(turn["model_tokens"] for turn in turns)),
            "observation_tokens": float(sum(turn.get("observation_tokens", 0) for turn in turns)),
            "tokenization_mismatch": float(mismatches),
        }
