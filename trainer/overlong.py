"""Overlong handling (DAPO, Yu et al. 2025): a soft penalty on responses that near the length budget (verl's
``reward_model.overlong_buffer``) and masking trajectories that ended by length out of the loss
(``algorithm.overlong_filtering``).

The penalty follows verl's DAPO reward manager: with L_max = ``data.max_response_length`` and L_buf =
``overlong_buffer.len``, a response of |y| tokens gets ``min(((L_max - L_buf) - |y|) / L_buf * penalty_factor, 0)``
added to its score, whatever ended it. |y| counts the response tokens of the trajectory's last segment, model and
observation tokens alike (verl counts the response's attended tokens): L_max is a segment's response budget, and
a trajectory ends by ``length`` when its last segment runs out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from agentloop.batch import RolloutBatch, last_segments
from agentloop.metrics import spread
from agentloop.settings.reading import Section


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens: 0 up to ``max_length - buffer_length``,
    then falling linearly to ``-penalty_factor`` at ``max_length``."""
    expected = max_length - buffer_length
    return ((expected - lengths.float()) / buffer_length * penalty_factor).clamp(max=0.0)


@dataclass(frozen=True)
class OverlongBuffer:
    """``reward_model.overlong_buffer`` as the trainer applies it."""

    max_length: int  # L_max: data.max_response_length
    length: int  # L_buf
    penalty_factor: float
    log: bool

    @classmethod
    def from_section(cls, buffer: Section, max_length: int) -> OverlongBuffer | None:
        """The buffer of ``buffer`` (``reward_model.overlong_buffer``), None when ``enable`` is off; ``max_length`` is
        L_max (``data.max_response_length``), and ``len`` must be in (0, L_max]."""
        if not buffer.bool("enable"):
            return None
        length = buffer.int("len")
        if not 0 < length <= max_length:
            raise buffer.error(
                "len",
                f"must be in (0, data.max_response_length={max_length}]: the penalty ramps over the last len tokens "
                "of the response budget",
                f"set it between 1 and {max_length}",
            )
        return cls(max_length, length, buffer.float("penalty_factor"), buffer.bool("log"))

    def penalties(self, rollout: RolloutBatch) -> torch.Tensor:
        """Each trajectory's penalty ``[trajectories]``, by its last segment's response length."""
        lengths = response_lengths(rollout.batch)[last_segments(rollout.batch["segment_index"])]
        return overlong_penalty(lengths, self.max_length, self.length, self.penalty_factor)

    def shape(self, rollout: RolloutBatch) -> dict[str, float]:
        """Add each trajectory's penalty to its score in ``rm_scores`` (on its last response token, where the score
        is); return ``overlong/*`` metrics when ``log``."""
        last = last_segments(rollout.batch["segment_index"])
        penalties, lengths, rows = (
            self.penalties(rollout),
            response_lengths(rollout.batch)[last],
            last.nonzero().squeeze(-1),
        )
        has_tokens = lengths > 0  # an empty response (a failed sample's) has no last token, and no penalty
        scores = rollout.batch["rm_scores"]
        scores[rows[has_tokens], lengths[has_tokens] - 1] += penalties[has_tokens]
        if not self.log:
            return {}
        return {
            **spread("overlong/reward", penalties.numpy()),
            "overlong/penalized_share": float((penalties < 0).float().mean()),
        }


def response_lengths(batch: TensorDict) -> torch.Tensor:
    """Each row's response tokens (attended: model and observation tokens) ``[B]``."""
    return batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(-1)


def mask_length_ended(rollout: RolloutBatch, batch: TensorDict) -> dict[str, float]:
    """Overlong filtering: zero ``batch``'s ``response_mask`` on every row of each trajectory that ended by
    ``length``, so it adds nothing to the losses; returns ``overlong/filtered_trajectories``."""
    length_ended = torch.from_numpy(
        np.asarray([reason == "length" for reason in rollout.non_tensor_batch["end_reason"]], dtype=bool)
    )
    batch["response_mask"] = batch["response_mask"] * (~length_ended).unsqueeze(-1).to(batch["response_mask"].dtype)
    return {"overlong/filtered_trajectories": float(length_ended[last_segments(batch["segment_index"])].sum())}
