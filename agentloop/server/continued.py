"""A turn continued across weight pushes: what the router does for agent loops and the OpenAI front for its clients,
neither of which can resume a turn cut off by new weights."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from agentloop.policy_versions import VersionRuns
from agentloop.protocol import TokenOutput
from agentloop.server.sampling import SAMPLING_DEFAULTS


async def generate_continued(
    generate: Callable[[list[int], dict[str, Any]], Awaitable[TokenOutput]],
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
) -> tuple[TokenOutput, VersionRuns, int]:
    """One turn through ``generate(ids, params)``, continued after each interruption by new weights: resubmitted
    with the tokens it has, for the tokens it has left, until it ends. Returns the whole turn, its tokens'
    policy versions and how many times it was interrupted."""
    budget = int(sampling_params.get("max_new_tokens", SAMPLING_DEFAULTS["max_new_tokens"]))
    tokens: list[int] = []
    log_probs: list[float] = []
    versions = VersionRuns()
    interruptions = 0
    while True:
        output = await generate(prompt_ids + tokens, {**sampling_params, "max_new_tokens": budget - len(tokens)})
        tokens += output.token_ids
        log_probs += output.log_probs
        versions.add(output.policy_version, len(output.token_ids))
        if output.finish_reason != "interrupted":
            break
        interruptions += 1
        if len(tokens) >= budget:  # interrupted right after its last token
            output.finish_reason = "length"
            break
    whole = TokenOutput(
        tokens,
        log_probs,
        output.finish_reason,
        output.cached_tokens,
        policy_version=output.policy_version,
        policy_versions=versions.per_token(),
    )
    return whole, versions, interruptions
