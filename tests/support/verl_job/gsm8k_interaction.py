"""A GSM8K user simulator in verl's style: says whether the last answer is right, until it is."""

from typing import Any, Optional
from uuid import uuid4

from agentloop.interactions.base import BaseInteraction
from agentloop.reward_score import gsm8k


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs) -> tuple[bool, str, float, dict]:
        replies = [message.get("content") or "" for message in messages if message.get("role") == "assistant"]
        self._instance_dict[instance_id]["response"] = replies[-1] if replies else ""
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
