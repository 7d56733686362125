"""The arithmetic task's tools: a calculator and an answer checker."""

from __future__ import annotations

import ast
import operator
from typing import Any

from agentloop.tools.base_tool import BaseTool
from agentloop.tools.schemas import ToolResponse

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(expression: str) -> int | float:
    """Evaluate + - * / // % and parentheses over numbers; anything else is a ValueError."""

    def visit(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](visit(node.left), visit(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](visit(node.operand))
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from error
    value = visit(tree)
    return int(value) if isinstance(value, float) and value.is_integer() else value


class CalculatorTool(BaseTool):
    """``calculator(expression)``: the value of an arithmetic expression."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return ToolResponse(text=str(evaluate(parameters["expression"]))), 0.0, {}


class AnswerTool(BaseTool):
    """``submit_answer(answer)``: records the final answer; reward 1.0 when it equals the ground truth."""

    def __init__(self, config, tool_schema) -> None:
        super().__init__(config, tool_schema)
        self._state: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str, ground_truth: Any = None, **kwargs: Any) -> str:
        self._state[instance_id] = {"ground_truth": ground_truth, "answer": None}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        state = self._state[instance_id]
        state["answer"] = parameters["answer"]
        correct = _same_number(state["answer"], state["ground_truth"])
        return ToolResponse(text="correct" if correct else "incorrect"), 0.0, {"correct": float(correct)}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state.get(instance_id, {})
        return float(_same_number(state.get("answer"), state.get("ground_truth")))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)


def _same_number(answer: Any, truth: Any) -> bool:
    try:
        return answer is not None and truth is not None and abs(float(answer) - float(truth)) < 1e-6
    except (TypeError, ValueError):
        return False
