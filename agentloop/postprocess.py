"""Pad finished trajectories into the trainer's tensor layout (see DESIGN.md, "Padded batch").

prompts are left-padded to P, responses right-padded to R; ``input_ids`` is prompts ‖ responses;
``position_ids`` count attended tokens (0 on padding); ``response_mask`` is 1 only on model tokens;
``rm_scores`` holds each trajectory's reward on its last response token (0 without one: every batch has
the same keys, so the parts of different workers always concatenate).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from agentloop.protocol import AgentLoopOutput


def pad_outputs(
    outputs: list[AgentLoopOutput], prompt_length: int, response_length: int, pad_token_id: int
) -> TensorDict:
    """Build the padded ``TensorDict`` for a list of trajectories (B = len(outputs))."""
    size = len(outputs)
    prompts = torch.full((size, prompt_length), pad_token_id, dtype=torch.long)
    prompt_attention = torch.zeros((size, prompt_length), dtype=torch.long)
    responses = torch.full((size, response_length), pad_token_id, dtype=torch.long)
    response_attention = torch.zeros((size, response_length), dtype=torch.long)
    response_mask = torch.zeros((size, response_length), dtype=torch.long)
    log_probs = torch.zeros((size, response_length), dtype=torch.float32)
    scores = torch.zeros((size, response_length), dtype=torch.float32)
    versions = torch.full((size, response_length), -1, dtype=torch.long)

    for row, output in enumerate(outputs):
        if len(output.prompt_ids) > prompt_length:
            raise ValueError(
                f"sample {row}: prompt has {len(output.prompt_ids)} tokens, more than prompt_length={prompt_length}"
            )
        n_prompt = len(output.prompt_ids)
        if n_prompt:
            prompts[row, -n_prompt:] = torch.tensor(output.prompt_ids)
            prompt_attention[row, -n_prompt:] = 1
        # A loop that overshoots the response budget is cut, never allowed to shift the layout.
        n_response = min(len(output.response_ids), response_length)
        if n_response:
            responses[row, :n_response] = torch.tensor(output.response_ids[:n_response])
            response_attention[row, :n_response] = 1
            response_mask[row, :n_response] = torch.tensor(output.response_mask[:n_response])
            log_probs[row, :n_response] = torch.tensor(output.response_logprobs[:n_response])
            if output.response_policy_versions is not None:
                versions[row, :n_response] = torch.tensor(output.response_policy_versions[:n_response])
            if output.reward_score is not None:
                scores[row, n_response - 1] = output.reward_score

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
    }
    return TensorDict(tensors, batch_size=[size])
