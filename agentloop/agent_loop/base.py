"""``AgentLoopBase``: what every agent loop gets at hand and the one method it must write."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from agentloop.protocol import AgentLoopOutput
from agentloop.router import Router


class AgentLoopBase:
    """Base of all agent loops. Subclasses implement ``run``; one instance serves one sample.

    Attributes:
        server_manager: the worker's ``Router``; call ``await self.server_manager.generate(request_id,
            prompt_ids, sampling_params)`` for each model turn.
        tokenizer: the model's tokenizer (chat template included).
        config: the full composed config; ``self.rollout`` is ``config.actor_rollout_ref.rollout``.
    """

    def __init__(
        self, *, server_manager: Router, tokenizer: PreTrainedTokenizerBase, config: DictConfig, **kwargs: Any
    ) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.config = config
        self.rollout = config.actor_rollout_ref.rollout

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        """Roll out one trajectory for a dataset row and return its tokens, mask and logprobs."""
        raise NotImplementedError(f"{type(self).__name__} must implement `async def run(self, sampling_params, **row)`")

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """Render chat messages with the generation prompt and fit them to ``rollout.prompt_length``.

        Over-long prompts follow ``data.truncation``: ``error`` (default) raises, ``left`` keeps the
        end, ``right`` keeps the beginning.
        """
        ids = list(
            self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        limit = int(self.rollout.prompt_length)
        if len(ids) <= limit:
            return ids
        mode = self.config.data.truncation
        if mode == "left":
            return ids[-limit:]
        if mode == "right":
            return ids[:limit]
        raise ValueError(
            f"prompt has {len(ids)} tokens, more than actor_rollout_ref.rollout.prompt_length={limit}; "
            "raise the limit (data.max_prompt_length) or set data.truncation=left|right"
        )
