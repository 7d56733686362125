"""Agent loops that exercise the stack itself, for tests and benchmarks (not for training)."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.agent_loop.base import AgentLoopBase
from agentloop.protocol import AgentLoopOutput
from agentloop.registry import register


@register("fixed_length")
class FixedLengthAgentLoop(AgentLoopBase):
    """One turn of exactly ``extra_info.length`` tokens (eos ignored), started after ``extra_info.delay_s``.

    Records the index of the server that served it in ``extra_fields["server"]``.
    """

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        extra_info = row["extra_info"]
        await asyncio.sleep(extra_info.get("delay_s", 0.0))
        prompt_ids = self.encode_prompt(row["prompt"])
        params = {**sampling_params, "max_new_tokens": extra_info["length"], "ignore_eos": True}
        server = self.server_manager.server_for(row["request_id"])
        output = await self.server_manager.generate(row["request_id"], prompt_ids, params)
        return AgentLoopOutput(
            prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs, extra_fields={"server": server}
        )
