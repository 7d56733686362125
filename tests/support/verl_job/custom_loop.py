"""A custom agent loop as verl's docs write one: render ``raw_prompt``, generate once, return the tokens."""

from typing import Any
from uuid import uuid4

from agentloop.agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("verl_style_agent")
class VerlStyleAgentLoop(AgentLoopBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_length = self.config.actor_rollout_ref.rollout.response_length

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.apply_chat_template(messages)
        output = await self.server_manager.generate(
            request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params, image_data=None
        )
        metrics = {"num_preempted": output.num_preempted if output.num_preempted is not None else -1}
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=output.token_ids[: self.response_length],
            response_mask=[1] * len(output.token_ids[: self.response_length]),
            response_logprobs=output.log_probs[: self.response_length] if output.log_probs else None,
            multi_modal_data={},
            num_turns=2,
            metrics=metrics,
        )
