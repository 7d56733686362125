"""``Gsm8kTool``: verl's GSM8K example tool (``verl.tools.gsm8k_tool.Gsm8kTool``) under the renamed path.

verl's ``examples/sglang_multiturn`` tool YAML names this class; with the package renamed it finds this one,
which behaves as verl's: the model submits an answer to ``calc_gsm8k_reward`` and hears how it scored.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from agentloop.reward_score import gsm8k
from agentloop.tools.base_tool import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from agentloop.utils.rollout_trace import rollout_trace_op

# what verl charges for a submission that scores no better than the one before it
NO_IMPROVEMENT_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    """Scores a submitted GSM8K answer against the row's ground truth, one record per trajectory.

    The schema comes from the tool YAML (verl's names the function ``calc_gsm8k_reward`` with one string
    argument, ``answer``). ``create`` takes ``ground_truth`` (the row's ``tools_kwargs.<tool>.create_kwargs``);
    ``execute`` records ``"#### <answer>"`` and returns ``"Current parsed answer=... reward=..."`` with a step
    reward of 0.0 when the score went up and -0.05 otherwise; ``calc_reward`` is the last submission's score
    (verl's ``gsm8k`` scorer, ``flexible``: the last number counts; 1.0 right, 0.0 wrong).
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}  # instance id -> {response, ground_truth, reward}

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        """Start a trajectory's record (a fresh id when none is given); returns ``(instance_id, ToolResponse())``."""
        instance_id = instance_id or str(uuid4())
        if ground_truth is None:  # verl also accepts the row's spec passed whole, as create_kwargs={...}
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Record the submitted answer and say how it scored; a submission that is no better costs a little."""
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The score of the last submitted answer (0 before any)."""
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(
            state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0
        )

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the trajectory's record."""
        del self._instance_dict[instance_id]
