"""Agent loops that exercise the stack itself, for tests and benchmarks (not for training)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.protocol import AgentLoopOutput
from agentloop.registry import register


@register("fixed_length")
class FixedLengthAgentLoop(AgentLoopBase):
    """One turn of exactly ``extra_info.length`` tokens (eos ignored), started after ``extra_info.delay_s``;
    under a request id of its own, as verl's loops generate, if ``extra_info.own_request_id``.

    Records the index of the server that served it in ``extra_fields["server"]``.
    """

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        extra_info = row["extra_info"]
        await asyncio.sleep(extra_info.get("delay_s", 0.0))
        prompt_ids = self.encode_prompt(row["prompt"])
        params = {**sampling_params, "max_new_tokens": extra_info["length"], "ignore_eos": True}
        request_id = uuid.uuid4().hex if extra_info.get("own_request_id") else row["request_id"]
        output = await self.server_manager.generate(request_id, prompt_ids, params)
        server = self.server_manager.server_of(request_id)
        return AgentLoopOutput(
            prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs, extra_fields={"server": server}
        )


@register("discarded_turn")
class DiscardedTurnAgentLoop(AgentLoopBase):
    """A turn of ``extra_info.length`` tokens (eos ignored) taken back, as the gateway takes back a cancelled call
    (``Trajectory.checkpoint``/``restore``), then one of as many kept. ``extra_fields["discarded_versions"]``: the
    taken-back turn's tokens' policy versions."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        length = row["extra_info"]["length"]
        params = {**sampling_params, "max_new_tokens": length, "ignore_eos": True}
        trajectory = self.start_trajectory(row)
        before = trajectory.checkpoint()
        discarded, _, _ = await trajectory.generate_turn(self.server_manager, row["request_id"], params, length)
        trajectory.restore(before)
        await trajectory.generate_turn(self.server_manager, row["request_id"], params, length)
        return trajectory.to_output(end_reason="length", extra_fields={"discarded_versions": discarded.policy_versions})


@register("picture_turns")
class PictureTurnsAgentLoop(AgentLoopBase):
    """``extra_info.turns`` model turns of exactly ``extra_info.length`` tokens (eos ignored), each but the last
    answered by a user turn showing a new picture, ``extra_info.sizes[k]`` (width, height) pixels at the k-th
    (cycled): a vision-language model's rollout with image observations."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        return await picture_turns(
            self.start_trajectory(row), self.server_manager, row["request_id"], sampling_params, row["extra_info"]
        )


async def picture_turns(
    trajectory: Any, router: Any, request_id: str, sampling_params: dict[str, Any], spec: dict[str, Any]
) -> AgentLoopOutput:
    """The turns of ``PictureTurnsAgentLoop`` on ``trajectory``, through anything with the router's ``generate``."""
    from PIL import Image

    params = {**sampling_params, "ignore_eos": True}
    for turn in range(spec["turns"]):
        await trajectory.generate_turn(router, request_id, params, len(trajectory.response_ids) + spec["length"])
        if turn < spec["turns"] - 1:
            size = tuple(spec["sizes"][turn % len(spec["sizes"])])
            picture = Image.new("RGB", size, ((80 * turn) % 256, 90, 200))
            message = {
                "role": "user",
                "content": [{"type": "text", "text": f"and picture {turn + 1}?"}, {"type": "image", "image": picture}],
            }
            trajectory.add_observation(trajectory.observation([message]))
    return trajectory.to_output(num_turns=2 * spec["turns"])


def rule_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    """A reward that costs nothing: 1.0 (the baseline of ``benchmarks.judge``)."""
    return 1.0


async def judged_reward(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any], judge: Any
) -> float:
    """A judge call of exactly ``extra_info.judge_length`` tokens (eos ignored) on the row's prompt text; 1.0."""
    await judge.chat(
        [{"role": "user", "content": extra_info["judge_prompt"]}],
        max_new_tokens=extra_info["judge_length"],
        ignore_eos=True,
    )
    return 1.0
