"""Tools that misbehave on purpose, for the tool-agent tests."""

from __future__ import annotations

import asyncio
from typing import Any

from agentloop.tasks.arithmetic.tools import CalculatorTool
from agentloop.tools import BaseTool, ToolResponse


class ExplodingTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        raise RuntimeError("boom")


class SleepyTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        await asyncio.sleep(float(self.config["sleep_s"]))
        return ToolResponse(text="woke up"), 0.0, {}


class EchoTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return ToolResponse(text=parameters["text"] * int(parameters.get("times", 1))), 0.0, {}


class SlowCreateTool(BaseTool):
    """Counts its creations; creating takes a while, so parallel first calls overlap."""

    creates = 0

    async def create(self, instance_id: str, **kwargs: Any) -> str:
        await asyncio.sleep(0.05)
        type(self).creates += 1
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return ToolResponse(text="ok"), 0.0, {}


class SteppedCalculatorTool(CalculatorTool):
    """The calculator, with the step reward ``config.step_reward`` for each call (per-turn rewards)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        response, _, metrics = await super().execute(instance_id, parameters, **kwargs)
        return response, float(self.config["step_reward"]), metrics
