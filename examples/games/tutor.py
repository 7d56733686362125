"""A user simulator for ``tool_agent``: a tutor that checks the model's answer and asks again if wrong."""

from __future__ import annotations

import re
from typing import Any

from agentloop.interactions import BaseInteraction

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ArithmeticTutor(BaseInteraction):
    """Ends the conversation on a correct answer (score 1.0); otherwise gives a hint (score 0.0)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.solved: dict[str, bool] = {}

    async def start_interaction(self, instance_id: str, **kwargs: Any) -> str:
        self.solved[instance_id] = False
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        reply = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        numbers = _NUMBER.findall(reply.split("</think>")[-1])
        if numbers and abs(float(numbers[-1]) - float(kwargs["ground_truth"])) < 1e-6:
            self.solved[instance_id] = True
            return True, "Well done.", 1.0, {}
        return False, f"Not quite. {self.config.get('hint', 'Check your arithmetic and try again.')}", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.solved.get(instance_id, False))

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.solved.pop(instance_id, None)
