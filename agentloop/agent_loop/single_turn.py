"""``single_turn_agent``: one prompt, one model answer."""

from __future__ import annotations

from typing import Any

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.agent_loop.trajectory import end_after
from agentloop.protocol import AgentLoopOutput, TurnRecord


class SingleTurnAgentLoop(AgentLoopBase):
    """Render the row's chat prompt, generate once, return the exact sampled tokens."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        trajectory = self.start_trajectory(row)
        output = await self.server_manager.generate(
            row["request_id"], trajectory.ids, sampling_params, image_data=trajectory.images or None
        )
        return AgentLoopOutput(
            prompt_ids=trajectory.prompt_ids,
            response_ids=output.token_ids,
            response_mask=[1] * len(output.token_ids),
            response_logprobs=output.log_probs,
            num_turns=2,
            metrics={"cached_tokens": float(output.cached_tokens)},
            end_reason=end_after(output.finish_reason) or "stop",
            turns=[TurnRecord(model_tokens=len(output.token_ids))],
            multi_modal_inputs=trajectory.multi_modal_inputs,
            policy_versions=output.policy_versions,
        )
