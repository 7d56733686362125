"""``Gsm8kInteraction``: verl's GSM8K example user (``verl.interactions.gsm8k_interaction.Gsm8kInteraction``)
under the renamed path.

verl's ``examples/sglang_multiturn`` interaction YAML names this class; with the package renamed it finds this
one, which behaves as verl's: it tells the model whether its last answer is right, and ends the conversation
when it is.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from agentloop.interactions.base import BaseInteraction
from agentloop.reward_score import gsm8k

CORRECT_REPLY = "Your response is correct!"
INCORRECT_REPLY = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """Grades the model's last turn against the row's ground truth with verl's ``gsm8k`` scorer, ``strict``:
    only an answer written as ``#### <number>`` counts. A right one ends the conversation (score 1.0); any other
    turn gets ``INCORRECT_REPLY`` and another try (score 0.0). ``start_interaction`` takes ``ground_truth``
    (the row's ``extra_info.interaction_kwargs``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}  # instance id -> {response, ground_truth}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> str:
        """Start a conversation's record (a fresh id when none is given); returns its id."""
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """Grade the last assistant message: ``(ends the conversation, reply, score, {})``."""
        assistant_turns = [message.get("content") or "" for message in messages if message.get("role") == "assistant"]
        self._instance_dict[instance_id]["response"] = assistant_turns[-1] if assistant_turns else ""
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, CORRECT_REPLY, score, {}
        return False, INCORRECT_REPLY, score, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        """The score of the last graded turn (0 before any)."""
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(
            state["response"], state["ground_truth"], method="strict", format_score=0.0, score=1.0
        )

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the conversation's record."""
        del self._instance_dict[instance_id]
