"""Policy versions: which weights (pushes applied, as the trainer numbers them) sampled a token.

One name throughout: a turn's ``TokenOutput.policy_version``, a sample's tokens' ``AgentLoopOutput.policy_versions``,
the batch's ``rollout_policy_versions`` ``[B, R]`` (named like ``rollout_log_probs``: what the rollout produced) and a
sample's ``policy_version`` stamp (the version its group started under). Only the HTTP fronts say SGLang's
``weight_version`` on the wire. ``UNKNOWN`` (-1) marks observation tokens and tokens of unknown version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNKNOWN = -1


@dataclass
class VersionRuns:
    """Consecutive tokens' policy versions as ``[version, count]`` runs: a long turn of one version costs one run."""

    runs: list[list[int]] = field(default_factory=list)

    def add(self, version: int | None, count: int) -> None:
        """Append ``count`` tokens of ``version`` (None: ``UNKNOWN``), merged with the last run when it has that version."""
        version = UNKNOWN if version is None else version
        if not count:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += count
        else:
            self.runs.append([version, count])

    def extend(self, other: VersionRuns) -> None:
        for version, count in other.runs:
            self.add(version, count)

    def per_token(self) -> list[int]:
        return [version for version, count in self.runs for _ in range(count)]


def on_response(response_mask: list[int], generated: list[int]) -> list[int]:
    """Each response token's policy version: the sample's generated tokens' versions (``Router.take_versions``), in
    order, on the model tokens (mask 1), ``UNKNOWN`` on observation tokens. A loop keeps its model tokens in the
    order they were generated and may cut the last ones (response length); model tokens beyond those recorded get
    ``UNKNOWN``."""
    remaining = iter(generated)
    return [next(remaining, UNKNOWN) if mask else UNKNOWN for mask in response_mask]
