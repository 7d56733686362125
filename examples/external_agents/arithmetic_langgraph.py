"""An arithmetic agent on LangGraph: a two-node graph (the chat model, then its tool calls) over ``ChatOpenAI`` with two
tools; it returns 1.0 when it submitted the right answer. Nothing here knows agentloop; ``external_agent`` hands it a
session's base URL and key:

    actor_rollout_ref.rollout.agent.external.function=examples.external_agents.arithmetic_langgraph.agent
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from examples.external_agents import arithmetic_tools

MAX_TURNS = 4


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. 12 * (3 + 4)."""
    return arithmetic_tools.calculator(expression)


async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    truth, submitted = row["reward_model"]["ground_truth"], []

    @tool
    def submit_answer(answer: float) -> str:
        """Submit the final numeric answer."""
        submitted.append(answer)
        return "correct" if arithmetic_tools.is_correct(answer, truth) else "incorrect"

    tools = [calculator, submit_answer]
    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0).bind_tools(tools)

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    try:  # each turn is two steps (model, tools)
        await graph.compile().ainvoke({"messages": list(row["prompt"])}, {"recursion_limit": 2 * MAX_TURNS})
    except GraphRecursionError:
        pass  # out of turns: judged on what it submitted
    return float(bool(submitted) and arithmetic_tools.is_correct(submitted[-1], truth))
