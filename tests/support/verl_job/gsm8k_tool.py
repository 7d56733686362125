"""A tool written for verl whose YAML entry has no ``tool_schema``: verl's GSM8K tool with a schema of its own."""

from agentloop.tools.gsm8k_tool import Gsm8kTool
from agentloop.tools.schemas import OpenAIFunctionToolSchema


class SchemaFromClassTool(Gsm8kTool):
    """A tool whose YAML entry has no tool_schema: its class supplies one, as verl allows."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "check_answer",
                    "description": "Check an answer to the problem",
                    "parameters": {
                        "type": "object",
                        "properties": {"answer": {"type": "string"}},
                        "required": ["answer"],
                    },
                },
            }
        )
