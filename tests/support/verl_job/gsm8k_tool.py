"""A GSM8K answer-checking tool in verl's style: the model submits an answer and hears its score."""

from typing import Any, Optional
from uuid import uuid4

from agentloop.reward_score import gsm8k
from agentloop.tools.base_tool import BaseTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        self._instance_dict[instance_id]["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        # submitting an answer that is no better than the last one costs a little
        step_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]


class SchemaFromClassTool(Gsm8kTool):
    """A tool whose YAML entry has no tool_schema: its class supplies one, as verl allows."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {
                "name": "check_answer",
                "description": "Check an answer to the problem",
                "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
            },
        })
