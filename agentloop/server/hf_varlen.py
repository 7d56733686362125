"""Attention for the ``hf`` engine's continuous batching on CPU: each request attends to its own keys only.

Without flash attention, transformers batches requests through SDPA over the whole batch: every query
token against every key of every request, with a dense mask hiding the other requests' keys, so a
step's attention grows with the square of the batch (256 decoding requests of 60 tokens: 18 ms per
layer on two cores, against 2.4 ms for their own keys only). ``agentloop_varlen`` takes the batch as
flash attention does (one packed sequence, cumulative query and key lengths, no mask), gathers each
request's keys into a padded batch and runs SDPA on that: the decoding requests (one query each) in
one call, the prefill chunks in another. Registered as a transformers attention function; the engine
switches the model to it once the batching manager is built (the manager accepts only its own names).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from agentloop.server.hf_batching import paged_keys_and_values

NAME = "agentloop_varlen"


def wanted(attention: str, model: PreTrainedModel) -> bool:
    """Whether the engine should switch ``model`` to this attention: ``rollout.hf.attention=auto`` on CPU,
    for a text model whose layers are all plain full causal attention (no sliding windows or logit
    soft-capping here); ``sdpa`` never."""
    if attention not in ("auto", "sdpa"):
        raise ValueError(f"rollout.hf.attention must be auto or sdpa, got {attention!r}")
    config = model.config.get_text_config()
    plain = set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    plain = (
        plain and getattr(config, "attn_logit_softcapping", None) is None and not hasattr(model.config, "vision_config")
    )
    return attention == "auto" and model.device.type == "cpu" and plain


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``query`` is ``[1, heads, tokens, head_dim]``; ``key``/``value``
    become every request's keys and values, packed, as the paged cache holds them."""
    if "cu_seq_lens_k" not in kwargs:
        raise RuntimeError(f"{NAME} serves continuous batching only (it needs the packed batch's sequence lengths)")
    key, value = paged_keys_and_values(module, key, value, kwargs)
    cu_seq_lens_k = kwargs["cu_seq_lens_k"]
    if key.shape[-2] != int(cu_seq_lens_k[-1]):
        raise RuntimeError(
            f"{NAME} got {key.shape[-2]} keys for a batch that reads {int(cu_seq_lens_k[-1])} from the paged cache"
        )
    output = varlen_attention(query[0], key[0], value[0], kwargs["cu_seq_lens_q"], cu_seq_lens_k, scaling)
    return output.unsqueeze(0), None


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of packed requests (``query`` ``[heads, Tq, d]``, ``key``/``value`` ``[kv_heads, Tk, d]``;
    request i's queries are the last of its keys); returns ``[Tq, heads, d]``."""
    starts_q, starts_k = cu_seq_lens_q[:-1].long(), cu_seq_lens_k[:-1].long()
    lengths_q, lengths_k = cu_seq_lens_q.diff().long(), cu_seq_lens_k.diff().long()
    output = query.new_zeros(query.shape[1], query.shape[0], query.shape[2])
    decoding = lengths_q == 1
    for group in (decoding, ~decoding & (lengths_q > 0)):
        if bool(group.any()):
            _attend(
                query, key, value, starts_q[group], lengths_q[group], starts_k[group], lengths_k[group], scaling, output
            )
    return output


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts_q: torch.Tensor,
    lengths_q: torch.Tensor,
    starts_k: torch.Tensor,
    lengths_k: torch.Tensor,
    scaling: float | None,
    output: torch.Tensor,
) -> None:
    requests, max_q, max_k = len(lengths_q), int(lengths_q.max()), int(lengths_k.max())
    positions_q, positions_k = torch.arange(max_q), torch.arange(max_k)
    real_q = positions_q < lengths_q[:, None]  # [requests, max_q]
    real_k = positions_k < lengths_k[:, None]  # [requests, max_k]
    index_q = (starts_q[:, None] + positions_q).masked_fill(~real_q, 0).flatten()
    index_k = (starts_k[:, None] + positions_k).masked_fill(~real_k, 0).flatten()
    # bottom-right causal: query t of a request sees its keys up to (keys - queries + t); padding rows still
    # see key 0, so no row is all masked (their outputs are dropped)
    visible = (positions_k <= (lengths_k - lengths_q)[:, None, None] + positions_q[:, None]) & real_k[:, None, :]

    def padded(packed: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:
        # ``packed`` [heads, tokens, d] is a view of [tokens, heads, d] memory: gathering whole rows of that copies
        # contiguous blocks, twice as fast as a strided gather (and index_select several times faster than indexing)
        rows = packed.transpose(0, 1).index_select(0, index)  # [requests * length, heads, d]
        return rows.view(requests, length, *rows.shape[1:]).transpose(1, 2)

    attended = F.scaled_dot_product_attention(
        padded(query, index_q, max_q),  # [requests, heads, max_q, d]
        padded(key, index_k, max_k),
        padded(value, index_k, max_k),
        attn_mask=visible[:, None],
        scale=scaling,
        enable_gqa=query.shape[0] != key.shape[0],
    )
    rows = attended.transpose(1, 2).reshape(requests * max_q, *output.shape[1:])
    real = real_q.flatten().nonzero().squeeze(1)
    output.index_copy_(0, index_q.index_select(0, real), rows.index_select(0, real))


AttentionInterface.register(NAME, varlen_attention_forward)
