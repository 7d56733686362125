"""Records that cross process boundaries: what an engine returns and what an agent loop returns; nothing else (the
engines' request checks are in ``agentloop.server.sampling``, the continuation of an interrupted turn in
``agentloop.server.continued``, the turns' totals in ``agentloop.turn_totals``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from agentloop.policy_versions import on_response

# Why one engine call stopped. ``interrupted``: new weights were loaded mid-request; the tokens so far
# come back and the router continues the request under the new weights (loops never see it).
FinishReason = Literal["stop", "length", "abort", "interrupted"]

# Why a trajectory ended, in every loop: ``stop`` the model answered and nothing continues the
# conversation; ``done`` the environment ended the episode; ``length`` the next turn or observation
# would not fit in rollout.response_length; ``max_turns`` a turn limit; ``tool_error_budget`` too many
# failed tool calls; ``env_error`` an env step kept failing; ``aborted`` the engine aborted the request;
# ``context_length`` the next context (a context strategy's rewrite) would leave no room for a model turn within
# rollout.max_model_len; ``failed`` the loop raised (the sample is kept, empty, and left out of training: see
# ``agentloop.worker.failed_output``).
# ``AgentLoopOutput.end_reason`` holds it (an engine call's FinishReason says ``abort`` where this says ``aborted``);
# the metrics ``multi_turn/finish_reason/*`` and the dumps' ``finish_reason`` column report it under verl's name.
EndReason = Literal[
    "stop", "done", "length", "context_length", "max_turns", "tool_error_budget", "env_error", "aborted", "failed"
]


@dataclass
class TokenOutput:
    """One engine call's result: the sampled ids exactly as produced, with their logprobs.

    ``log_probs[i]`` is the log-probability of ``token_ids[i]`` under the distribution the sampler drew
    from (logits divided by temperature, after top-k/top-p filtering when those are active).
    """

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    cached_tokens: int = 0
    # the policy version (``agentloop.policy_versions``) that sampled these tokens, set by the rollout server; a
    # request the router continued after an interruption reports its last part's
    policy_version: int | None = None
    # verl's TokenOutput fields that loops written for verl read; not produced by these engines
    num_preempted: int | None = None
    routed_experts: Any = None
    # each token's policy version (a turn continued across weight pushes spans several), set by the router
    # (``agentloop.server.continued``): what ``Trajectory`` appends with the tokens; None from an engine itself
    policy_versions: list[int] | None = None


@dataclass
class ToolCallRecord:
    """One tool call of a model turn: what the model asked for, the text that came back, the seconds it took and
    its error kind (``agentloop.tools.toolset.ToolResult.error``; ``too_many_calls`` for a call not run), or None."""

    name: str
    arguments: Any
    result: str
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class TurnRecord:
    """One model turn of a trajectory and what answered it; ``Trajectory`` keeps one per model turn (a turn aborted
    before its first token too, with ``model_tokens`` 0) and the loops add what their turn steps did."""

    model_tokens: int
    observation_tokens: int = 0  # of the observation that answered it; 0: none (the last turn, or one taken back)
    calls: list[ToolCallRecord] = field(default_factory=list)  # those run, then those dropped past max_parallel_calls
    dropped_calls: int = 0
    step_reward: float = 0.0  # the sum of its tools' step rewards
    interaction_score: float | None = None  # the interaction's score of this turn, when the interaction answered it
    env_reward: float = 0.0  # the environment's info["reward"] for the step this turn took
    env_retries: dict[str, int] = field(default_factory=dict)  # its failed env steps by kind
    # the environment state this turn answered (GiGPO's step groups): the env's ``state_key()`` hook, else a digest of
    # the observation it answered (of the prompt, for the first turn); None: not recorded
    state_key: str | None = None

    @property
    def reward(self) -> float:
        """What its tools, the interaction and the environment reported for this turn (the batch's ``turn_rewards``)."""
        return self.step_reward + (self.interaction_score or 0.0) + self.env_reward

    @property
    def tool_calls(self) -> int:
        """The calls run (those past ``max_parallel_calls`` are not)."""
        return len(self.calls) - self.dropped_calls

    @property
    def tool_errors(self) -> int:
        """The calls that failed, dropped ones included."""
        return sum(call.error is not None for call in self.calls)

    @property
    def tool_latency_s(self) -> float:
        """The seconds its tools took: its calls run in parallel."""
        return max((call.latency_s for call in self.calls), default=0.0)


@dataclass
class RewardParts:
    """What a trajectory's own sources scored it; ``agentloop.rewards`` adds them up when no reward function scores
    its row. None (or no tools): the trajectory had no such source."""

    tools: dict[str, float] = field(default_factory=dict)  # each tool's calc_reward, by tool name
    interaction: float | None = None  # the interaction's calculate_score
    env: float | None = None  # the sum of the environment's info["reward"] values

    def by_source(self) -> dict[str, float]:
        """``tool/<name>``, ``interaction`` and ``env`` -> value, for the sources present (what a reward function
        gets as ``extra_info["rollout_reward_scores"]``)."""
        parts = {f"tool/{name}": float(value) for name, value in self.tools.items()}
        for source, value in (("interaction", self.interaction), ("env", self.env)):
            if value is not None:
                parts[source] = float(value)
        return parts


@dataclass
class Failure:
    """Why a sample failed: its loop, or its scoring, raised ``error`` (``"Type: message"``) with ``traceback``."""

    error: str
    traceback: str


@dataclass
class Segment:
    """One context a trajectory's model turns were sampled under, and what followed it: ``prompt_ids`` the exact
    context of its first model turn, then the response (model tokens with their logprobs, mask 1; observations,
    mask 0) as far as each next context extended it exactly. ``rewritten_by`` names what made this context (the
    context strategy, ``agentloop.agent_loop.context``); None for a trajectory's first segment, which starts at the
    row's prompt. ``multi_modal_inputs``: the processor's outputs for exactly the images its ids show.
    ``closing_observation_ids``: the observation that closed it (the next context shows it re-rendered), as the ids
    an unrewritten context would have appended after its response; empty for a trajectory's last segment."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    multi_modal_inputs: dict[str, Any] | None = None
    policy_versions: list[int] | None = None
    rewritten_by: str | None = None
    closing_observation_ids: list[int] = field(default_factory=list)


# Where a sample's reward came from (``agentloop.rewards``): the loop set it, a reward function computed it, the
# discriminative reward model scored it, the reward parts added up, or nothing scored it.
RewardSource = Literal["agent_loop", "reward_function", "reward_model", "reward_parts", "none"]


@dataclass
class AgentLoopOutput:
    """One finished trajectory, ready to be padded into the trainer's batch.

    ``response_mask`` is 1 on tokens the model produced and 0 on observation tokens (tool results,
    user turns); ``response_logprobs`` is the engine's logprob on model tokens and 0.0 elsewhere, or
    None when the loop did not keep them (as verl allows: the batch then has 0.0 there,
    ``rollout_log_probs_missing`` is set, and the trainer refuses to correct against them).
    ``reward_score`` set by the loop is kept; otherwise the worker computes it (``agentloop.rewards``).
    ``multi_modal_inputs``: the processor's outputs for the trajectory's images, merged once at its end
    (``pixel_values [patches, dim]``, ``image_grid_thw [images, 3]``); None for text.
    ``multi_modal_data`` and ``routed_experts`` are accepted as verl's loops pass them.
    ``policy_versions``: the policy version of each response token, -1 on observation tokens, kept with the tokens
    (``Trajectory`` appends each turn's ``TokenOutput.policy_versions``); for a loop that leaves them None (one
    written for verl, which builds its output itself), the worker fills them from the router's record of the
    sample's sessions, matched to the model tokens in order (``set_policy_versions``).

    What the framework reads of a trajectory is in typed fields, which a loop sets (``Trajectory.to_output`` sets
    ``turns``, ``observation_roles`` and ``num_turns``) and which default to "not reported": ``end_reason`` (None
    counts as ``unknown``), ``turns`` (one ``TurnRecord`` per model turn), ``observation_roles`` (who spoke in each
    masked span, in order) and ``reward_parts``. A loop that scores the sample itself sets ``reward_score`` and may
    set ``reward_extra_info`` (what its scoring returned beside the score, as a reward function's dict); a loop whose
    answer is not its decoded response (an external agent's final message) sets ``solution_str``, the text the
    reward function scores instead. What the worker adds when it scores the sample is not here but in its
    ``SampleScore``. ``extra_fields`` is the loop's own: the framework carries it into the batch and the dumps and
    never reads it.

    A trajectory whose context was rewritten (a context strategy, or a loop that sends contexts that are not exact
    extensions of each other) has several segments: ``segments`` holds the earlier ones, oldest first, and the
    fields above (``prompt_ids`` ... ``policy_versions``, ``multi_modal_inputs``; ``rewritten_by``) are its last,
    on which its reward sits. ``all_segments()`` lists them all; each becomes one row of the batch.
    ``whole_response_ids()`` is the response they make together, what its reward scores.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    num_turns: int = 2
    reward_score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)
    multi_modal_data: dict[str, Any] | None = None
    multi_modal_inputs: dict[str, Any] | None = None
    routed_experts: Any = None
    policy_versions: list[int] | None = None
    end_reason: EndReason | None = None
    turns: list[TurnRecord] = field(default_factory=list)
    observation_roles: list[str] = field(default_factory=list)
    reward_parts: RewardParts = field(default_factory=RewardParts)
    reward_extra_info: dict[str, Any] = field(default_factory=dict)
    solution_str: str | None = None
    rollout_log_probs_missing: bool = False
    segments: list[Segment] = field(default_factory=list)
    rewritten_by: str | None = None

    def __post_init__(self) -> None:
        if hasattr(self.metrics, "model_dump"):  # verl's AgentLoopMetrics
            self.metrics = self.metrics.model_dump()
        if self.response_logprobs is None:
            self.response_logprobs = [0.0] * len(self.response_ids)
            self.rollout_log_probs_missing = True
        lengths = {len(self.response_ids), len(self.response_mask), len(self.response_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                "AgentLoopOutput: response_ids, response_mask and response_logprobs must have the same "
                f"length, got {len(self.response_ids)}, {len(self.response_mask)}, {len(self.response_logprobs)}"
            )

    def all_segments(self) -> list[Segment]:
        """Every segment of the trajectory, oldest first: ``segments`` and the last one (this output's own fields)."""
        last = Segment(
            self.prompt_ids,
            self.response_ids,
            self.response_mask,
            self.response_logprobs,
            self.multi_modal_inputs,
            self.policy_versions,
            self.rewritten_by,
        )
        return [*self.segments, last]

    def whole_response_ids(self, segment_length: int | None = None) -> list[int]:
        """The whole response, each model turn and observation once, in order: what reward functions, reward models
        and judges score. Each segment's response (cut to ``segment_length``, as the batch holds it), then the
        observation that closed it (``Segment.closing_observation_ids``): for a rewritten trajectory, the response an
        unrewritten context would have had; for a trajectory of one segment, its ``response_ids``."""
        ids: list[int] = []
        for segment in self.all_segments():
            ids += segment.response_ids[:segment_length] + segment.closing_observation_ids
        return ids

    def has_policy_versions(self) -> bool:
        """Whether every segment carries one policy version per response token (the loop kept them)."""
        return all(
            segment.policy_versions is not None and len(segment.policy_versions) == len(segment.response_mask)
            for segment in self.all_segments()
        )

    def set_policy_versions(self, generated: list[int]) -> None:
        """Set each segment's ``policy_versions`` (``agentloop.policy_versions.on_response``) from the sample's
        generated tokens' versions (``Router.take_versions``), which run through its segments in order."""
        versions = on_response([mask for segment in self.all_segments() for mask in segment.response_mask], generated)
        for segment in self.segments:
            segment.policy_versions, versions = (
                versions[: len(segment.response_mask)],
                versions[len(segment.response_mask) :],
            )
        self.policy_versions = versions


@dataclass
class SampleScore:
    """What the worker adds to a loop's output when it scores the sample (``agentloop.rewards.score_output``) or
    its loop raised (``agentloop.worker.failed_output``): where the reward came from, what the reward function
    returned beside the score (a loop-scored sample: the loop's ``AgentLoopOutput.reward_extra_info``), why the
    sample failed, and the judge's calls for it (``agentloop.judge.JudgeCall``, with ``reward_model.enable``)."""

    reward_source: RewardSource | None = None
    reward_extra_info: dict[str, Any] = field(default_factory=dict)
    failure: Failure | None = None
    judge_calls: list[Any] = field(default_factory=list)


# The fields of SampleScore that the padded batch carries per sample, as non_tensor_batch columns of these names.
SCORE_FIELDS = tuple(item.name for item in fields(SampleScore))

# The fields of AgentLoopOutput that the padded batch carries per sample, as non_tensor_batch columns of these names.
BATCH_FIELDS = (
    "num_turns",
    "reward_score",
    "metrics",
    "extra_fields",
    "end_reason",
    "turns",
    "observation_roles",
    "reward_parts",
    "rollout_log_probs_missing",
)
