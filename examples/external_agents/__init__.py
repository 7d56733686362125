"""Agent programs written against real client libraries (OpenAI SDK, OpenAI Agents SDK, LangGraph), trained
unchanged through agentloop's session gateway (``external_agent``): only their base URL points at agentloop."""
