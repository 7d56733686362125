"""Pad finished trajectories into the trainer's tensor layout (docs/reference/agent-loop-output.md, "The batch").

One row per segment (``AgentLoopOutput.all_segments``; one per trajectory unless its context was rewritten), a
trajectory's rows consecutive and oldest first; ``segment_index [B]`` numbers them (0 starts a trajectory).
prompts are left-padded to P (``rollout.prompt_length``, or the longest rewritten context when that is longer),
responses right-padded to R; ``input_ids`` is prompts ‖ responses;
``position_ids`` count attended tokens (0 on padding); ``response_mask`` is 1 only on model tokens;
``rm_scores`` holds each trajectory's reward on its last segment's last response token (0 without one: every batch has
the same keys, so the parts of different workers always concatenate); a non-zero reward whose last segment has no
response token is an error (``check_reward_has_a_token``), never dropped.

Per turn: ``turn_index [B, R]`` numbers the loop's model turn (its place in ``AgentLoopOutput.turns``,
from 0) of each response token: a model token's own turn, an observation token's the turn it answers; -1 on padding.
``turn_rewards [B, R]`` holds each turn's reward (``TurnRecord.reward``: what its tools, the interaction or the env
reported for it) on that turn's last model token, in the row of the segment holding it; a turn without a model token
in the batch (one aborted before its first token, or cut) gives its reward to the model token before it, else the
trajectory's first. A trajectory whose turns do not add up to its model tokens (a loop that records no turns) is one
turn: 0 on all its response tokens, the turns' rewards on its last model token.

A vision-language model's batch also carries its images, dense-padded per sample so that ``split``,
indexing and ``to`` keep every sample's images with it: ``pixel_values [B, patches, dim]`` (zeros past a
sample's own patches) and ``image_grid_thw [B, images, 3]`` (zero rows past its own images); and its
``position_ids`` are M-RoPE's ``[B, 4, P+R]``: row 0 the plain positions above, rows 1-3 the temporal,
height and width positions from the model's ``get_rope_index`` (the layout verl uses too).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from agentloop.images import mrope_positions
from agentloop.protocol import AgentLoopOutput, Segment, TurnRecord


def _segment_rows(outputs: list[AgentLoopOutput], prompt_length: int) -> list[tuple[int, Segment, float | None]]:
    """``(segment index, segment, the reward on its last token)`` per batch row, each trajectory's first prompt
    checked against ``prompt_length`` and each reward against the tokens that can hold it."""
    rows: list[tuple[int, Segment, float | None]] = []
    for output in outputs:
        check_reward_has_a_token(output)
        segments = output.all_segments()
        rows += [
            (index, segment, output.reward_score if segment is segments[-1] else None)
            for index, segment in enumerate(segments)
        ]
    for position, (index, segment, _) in enumerate(rows):
        if index == 0 and len(segment.prompt_ids) > prompt_length:
            raise ValueError(
                f"row {position}: prompt has {len(segment.prompt_ids)} tokens, more than prompt_length={prompt_length}"
            )
    return rows


def pad_outputs(
    outputs: list[AgentLoopOutput],
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    vision_model: Any = None,
) -> TensorDict:
    """Build the padded ``TensorDict`` for a list of trajectories (one row per segment); with ``vision_model`` (a
    VLM's structure, ``agentloop.models.loading.structure``), its images and M-RoPE positions too."""
    rows = _segment_rows(outputs, prompt_length)
    prompt_length = max([prompt_length, *(len(segment.prompt_ids) for _, segment, _ in rows)])
    size = len(rows)
    prompts = torch.full((size, prompt_length), pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros((size, prompt_length), dtype=torch.long)
    responses = torch.full((size, response_length), pad_token_id, dtype=torch.long)
    response_attention = torch.zeros((size, response_length), dtype=torch.long)
    response_mask = torch.zeros((size, response_length), dtype=torch.long)
    log_probs = torch.zeros((size, response_length), dtype=torch.float32)
    scores = torch.zeros((size, response_length), dtype=torch.float32)
    versions = torch.full((size, response_length), -1, dtype=torch.long)

    for row, (_, segment, reward) in enumerate(rows):
        n_prompt = len(segment.prompt_ids)
        if n_prompt:
            prompts[row, -n_prompt:] = torch.tensor(segment.prompt_ids)
            prompt_attention[row, -n_prompt:] = 1
        # A loop that overshoots the response budget is cut, never allowed to shift the layout.
        n_response = min(len(segment.response_ids), response_length)
        if n_response:
            responses[row, :n_response] = torch.tensor(segment.response_ids[:n_response])
            response_attention[row, :n_response] = 1
            response_mask[row, :n_response] = torch.tensor(segment.response_mask[:n_response])
            log_probs[row, :n_response] = torch.tensor(segment.response_logprobs[:n_response])
            if segment.policy_versions is not None:
                versions[row, :n_response] = torch.tensor(segment.policy_versions[:n_response])
            if reward is not None:
                scores[row, n_response - 1] = reward

    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    position_ids = (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0) * attention_mask
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "rollout_log_probs": log_probs,
        # the policy version that sampled each model token (-1: observation, padding, or unknown)
        "rollout_policy_versions": versions,
        "rm_scores": scores,
        **_turn_tensors(outputs, response_length),  # and each turn's own reward: turn_rewards
        "segment_index": torch.tensor([index for index, _, _ in rows], dtype=torch.long),
    }
    if vision_model is not None:
        tensors.update(_images([segment for _, segment, _ in rows], vision_model, tensors["input_ids"], attention_mask))
    return TensorDict(tensors, batch_size=[size])


def check_reward_has_a_token(output: AgentLoopOutput) -> None:
    """ValueError when the trajectory's reward is not 0 and its last segment has no response token to hold it: the
    batch's ``rm_scores`` would sum to 0 where ``reward_score`` says otherwise (a loop's record that ends on an empty
    segment is a bug; the worker fails the sample with this error, and ``pad_outputs`` refuses the batch)."""
    if output.reward_score and not output.response_ids:
        raise ValueError(
            f"the trajectory's reward {output.reward_score} has no response token to sit on: its last segment "
            f"(of {len(output.segments) + 1}) has none; it would be dropped from the batch's rm_scores"
        )


def _turn_tensors(outputs: list[AgentLoopOutput], response_length: int) -> dict[str, torch.Tensor]:
    """``turn_index`` and ``turn_rewards`` (the module docstring), one row per segment."""
    layouts = [
        layout for output in outputs for layout in _turn_layout(output.turns, output.all_segments(), response_length)
    ]
    turn_index = torch.full((len(layouts), response_length), -1, dtype=torch.long)
    turn_rewards = torch.zeros((len(layouts), response_length), dtype=torch.float32)
    for row, (turns, rewards) in enumerate(layouts):
        turn_index[row, : len(turns)] = turns
        turn_rewards[row, : len(rewards)] = rewards
    return {"turn_index": turn_index, "turn_rewards": turn_rewards}


def _turn_layout(
    turns: list[TurnRecord], segments: list[Segment], response_length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per segment, for its response tokens kept in the batch (the first ``response_length``): each token's turn and
    each turn's reward on its last model token (the module docstring says where a reward goes otherwise)."""
    lengths = [len(segment.response_ids) for segment in segments]
    mask = torch.tensor([value for segment in segments for value in segment.response_mask], dtype=torch.long)
    counts = torch.tensor([turn.model_tokens for turn in turns], dtype=torch.long)
    described = bool(turns) and int(counts.sum()) == int(mask.sum())
    # each model token's turn, in order through the segments (turn t owns the next turns[t].model_tokens of them); an
    # observation token's is that of the model token before it
    owners = (
        torch.repeat_interleave(torch.arange(len(turns)), counts) if described else torch.zeros_like(mask[mask > 0])
    )
    turn_of = owners[(mask.cumsum(0) - 1).clamp(min=0)] if len(owners) else torch.zeros_like(mask)
    kept = torch.cat([torch.arange(length) < response_length for length in lengths])
    kept_model = (mask.bool() & kept).nonzero().flatten()  # positions through the segments, in order
    rewards = torch.zeros(len(mask), dtype=torch.float64)
    for t, record in enumerate(turns):
        if record.reward and len(kept_model):
            # its last kept model token, else the last one before it, else the first (undescribed: the last of all)
            before = (
                int(torch.searchsorted(turn_of[kept_model], t, right=True)) - 1 if described else len(kept_model) - 1
            )
            rewards[kept_model[max(before, 0)]] += record.reward
    starts = [sum(lengths[:number]) for number in range(len(segments))]
    return [
        (
            turn_of[start : start + min(length, response_length)],
            rewards[start : start + min(length, response_length)].float(),
        )
        for start, length in zip(starts, lengths)
    ]


def _images(
    segments: list[Segment], vision_model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    vision = vision_model.config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    inputs = [segment.multi_modal_inputs or {} for segment in segments]
    grids = [part.get("image_grid_thw", torch.zeros((0, 3), dtype=torch.long)) for part in inputs]
    pixels = [part.get("pixel_values", torch.zeros((0, patch_dim))) for part in inputs]
    pixel_values = torch.zeros((len(segments), max(len(p) for p in pixels), patch_dim))
    image_grid_thw = torch.zeros((len(segments), max(len(g) for g in grids), 3), dtype=torch.long)
    for row, (grid, pixel) in enumerate(zip(grids, pixels)):
        pixel_values[row, : len(pixel)] = pixel
        image_grid_thw[row, : len(grid)] = grid
    return {
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "position_ids": mrope_positions(vision_model, input_ids, torch.cat(grids), attention_mask)
        .permute(1, 0, 2)
        .contiguous(),
    }
