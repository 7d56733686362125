"""``hf`` engines with one transformers internal broken on purpose, for the start-up self-test's tests.

Named by dotted path in ``actor_rollout_ref.rollout.name``: each breaks the internal inside its own rollout
server's process only, then starts the real ``HFEngine``.
"""

from __future__ import annotations

from typing import Any

from transformers import AttentionInterface

from agentloop.server import hf_varlen
from agentloop.server.hf_engine import HFEngine
from agentloop.settings import ServerSettings


def raising_attention(*args: Any, **kwargs: Any) -> Any:
    """An attention function that fails as 5.24 made ours fail: every continuous-batching step raises."""
    raise RuntimeError("attention broken on purpose")


def attention_with_a_wrong_scale(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, **kwargs: Any
) -> Any:
    """Runs without an error and gives finite logits, but wrong ones (as a changed default would)."""
    return hf_varlen.varlen_attention_forward(module, query, key, value, attention_mask, scaling=scaling / 4, **kwargs)


class RaisingAttentionEngine(HFEngine):
    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> HFEngine:
        AttentionInterface.register(hf_varlen.NAME, raising_attention)
        return super().from_settings(settings, rank)
