"""``AgentLoopBase``: what every agent loop gets at hand and the one method it must write.

The constructor takes verl's arguments too (``trainer_config``, ``processor``, ``dataset_cls``,
``dataset_config``), in verl's order, so a loop written for verl runs with its imports renamed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable

from cachetools import LRUCache
from omegaconf import DictConfig
from transformers import PreTrainedTokenizerBase

from agentloop.agent_loop.context import context_strategy, max_model_len
from agentloop.agent_loop.trajectory import Trajectory
from agentloop.images import expand_image_pads, process_images, split_images
from agentloop.protocol import AgentLoopOutput
from agentloop.router import Router


# name -> {"_target_": class or dotted path, **extra constructor kwargs}; agentloop.registry reads it
_REGISTRY: dict[str, dict[str, Any]] = {}
# (tokenizer id, messages, tools, template kwargs and template as JSON) -> (that tokenizer, the prompt's ids)
_PROMPT_RENDERS: LRUCache = LRUCache(maxsize=256)


def register(name: str, lora_adapter: str | None = None) -> Callable[[type], type]:
    """Class decorator: make an agent loop selectable by rows whose ``agent_name`` is ``name``; its samples are
    generated with, and train, the LoRA adapter ``lora_adapter`` (``actor_rollout_ref.model.lora_adapters``; None:
    the first)."""

    def decorator(cls: type) -> type:
        _REGISTRY[name] = {"_target_": cls, **({"lora_adapter": lora_adapter} if lora_adapter else {})}
        return cls

    return decorator


@dataclass
class DictConfigWrap:
    """A config handed to a loop without hydra's ``instantiate`` resolving it (verl's wrapper)."""

    config: DictConfig


class AgentLoopBase:
    """Base of all agent loops. Subclasses implement ``run``; one instance serves one sample.

    Attributes:
        server_manager: the worker's ``Router``; call ``await self.server_manager.generate(request_id,
            prompt_ids, sampling_params)`` for each model turn.
        tokenizer: the model's tokenizer (chat template included); ``processor`` is None for text models.
        config: the full composed config; ``self.rollout`` is ``config.actor_rollout_ref.rollout`` and
            ``self.dataset_config`` is ``config.data``.
    """

    def __init__(
        self,
        trainer_config: DictConfigWrap | None = None,
        server_manager: Router | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        processor: Any = None,
        dataset_cls: Any = None,
        dataset_config: DictConfigWrap | None = None,
        *,
        config: DictConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config if config is not None else trainer_config.config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.dataset_config = dataset_config.config if dataset_config is not None else self.config.data
        self.rollout = self.config.actor_rollout_ref.rollout
        self.apply_chat_template_kwargs = dict(self.dataset_config.get("apply_chat_template_kwargs") or {})

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        """Roll out one trajectory for a dataset row and return its tokens, mask and logprobs."""
        raise NotImplementedError(f"{type(self).__name__} must implement `async def run(self, sampling_params, **row)`")

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        remove_system_prompt: bool = False,
    ) -> list[int]:
        """verl's helper: the ids of ``messages`` rendered with the generation prompt (``data.apply_chat_template_kwargs``
        applied), rendered off the event loop; ``remove_system_prompt`` drops the template's default system
        prompt, for a delta appended to a conversation. Unlike ``encode_prompt``, nothing is truncated."""
        if images or videos:
            raise ValueError(
                "images and videos need a vision-language model's processor; this loop has a text tokenizer"
            )
        ids = await asyncio.get_running_loop().run_in_executor(None, self._render_prompt, messages, tools)
        if remove_system_prompt:
            default_system = self._default_system_prompt()
            if ids[: len(default_system)] == default_system:
                ids = ids[len(default_system) :]
        return ids

    def _default_system_prompt(self) -> list[int]:
        """What the template renders for an empty conversation: the system prompt it adds on its own."""
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    [{}],
                    add_generation_prompt=False,
                    tokenize=True,
                    return_dict=False,
                    **self.apply_chat_template_kwargs,
                )
            )
        except Exception:  # a template that cannot render an empty message adds no system prompt of its own
            return []

    def start_trajectory(self, row: dict[str, Any], tools: list[dict] | None = None) -> Trajectory:
        """A trajectory holding the row's prompt (``encode_prompt``) and, for a vision-language model, its images:
        those in the messages' content parts and the row's ``images`` column (one per ``<image>`` placeholder or
        bare image part), each processed once, their pads expanded in the prompt ids; its contexts follow
        ``multi_turn.context`` within ``rollout.max_model_len``."""
        messages, images = row["prompt"], []
        if self.processor is not None or row.get("images") is not None:
            where = f"row {row.get('index')} (request {row.get('request_id')})"
            messages, images = split_images(messages, row.get("images"), where)
            processed = process_images(self.processor, images, where)
            ids = self.encode_prompt(messages, tools=tools, images=processed)
        else:
            processed, ids = [], self.encode_prompt(messages, tools=tools)
        return Trajectory(
            self.tokenizer,
            messages,
            ids,
            tools,
            self.apply_chat_template_kwargs,
            self.processor,
            processed,
            context=context_strategy(self.rollout.multi_turn),
            max_model_len=max_model_len(self.rollout),
        )

    def _render_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **self.apply_chat_template_kwargs,
            )
        )

    def _cached_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        # a group's samples share their prompt: rendering it (template and tokenizer) once per worker, not once per
        # sample, takes a tenth of a worker's time off its busiest path
        try:
            template = getattr(self.tokenizer, "chat_template", None)  # which a caller may set on the same tokenizer
            key = (
                id(self.tokenizer),
                json.dumps([messages, tools, self.apply_chat_template_kwargs, template], sort_keys=True),
            )
        except TypeError:  # something only the template can render (not JSON): no key, no cache
            return self._render_prompt(messages, tools)
        if key not in _PROMPT_RENDERS:  # the entry holds the tokenizer, so no other tokenizer can take its id
            _PROMPT_RENDERS[key] = (self.tokenizer, tuple(self._render_prompt(messages, tools)))
        return list(_PROMPT_RENDERS[key][1])

    def encode_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None, images: list[Any] | None = None
    ) -> list[int]:
        """Render chat messages with the generation prompt (and ``data.apply_chat_template_kwargs``) and fit
        them to ``rollout.prompt_length``.

        Over-long prompts follow ``data.truncation``: ``error`` (default) raises, ``left`` keeps the
        end, ``right`` keeps the beginning. ``images`` (processed; ``start_trajectory`` passes them) widen their
        pads; a prompt with images is never cut (that could split an image): too long is an error.
        """
        if self.processor is not None:
            ids = self._render_prompt(messages, tools)
            ids = expand_image_pads(
                ids, images or [], self.tokenizer.convert_tokens_to_ids(self.processor.image_token), "prompt"
            )
        else:
            ids = self._cached_prompt(messages, tools)
        limit = int(self.rollout.prompt_length)
        if len(ids) <= limit:
            return ids
        if images:
            raise ValueError(
                f"prompt has {len(ids)} tokens with its {len(images)} image(s) expanded, more than "
                f"actor_rollout_ref.rollout.prompt_length={limit}; raise data.max_prompt_length or use smaller images"
            )
        mode = self.config.data.truncation
        if mode == "left":
            return ids[-limit:]
        if mode == "right":
            return ids[:limit]
        raise ValueError(
            f"prompt has {len(ids)} tokens, more than actor_rollout_ref.rollout.prompt_length={limit}; "
            "raise the limit (data.max_prompt_length) or set data.truncation=left|right"
        )
