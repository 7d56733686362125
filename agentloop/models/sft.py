"""Short supervised fine-tuning on rendered chat text: the warm start for tiny models on CPU.

Deterministic for a seed (fixed data order, fixed init of the optimizer), minutes at most on CPU.
Loss is taken on assistant tokens only, so the model learns to answer, not to predict observations.
``finetune`` trains a text model on rendered chat text; ``finetune_chats`` a vision-language model on
conversations with images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentloop.images import (
    ProcessedImage,
    expand_image_pads,
    image_inputs,
    mrope_positions,
    process_images,
    split_images,
)
from agentloop.models.cache import build_once
from agentloop.models.loading import load_processor, model_class, without_vision_tokens


def assistant_token_mask(ids: list[int], assistant_header: list[int], end_id: int) -> list[int]:
    """1 on the tokens of assistant turns: after each ``<|im_start|>assistant\n`` through its ``<|im_end|>``."""
    mask, i, width = [0] * len(ids), 0, len(assistant_header)
    while i < len(ids):
        if ids[i : i + width] != assistant_header:
            i += 1
            continue
        i += width
        while i < len(ids):
            mask[i] = 1
            i += 1
            if ids[i - 1] == end_id:
                break
    return mask


def finetune(
    base_path: str,
    texts: list[str],
    out_dir: str,
    *,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
    batch_size: int | None = None,
    desc: str = "fine-tuning",
    stop_margin: float | None = None,
) -> str:
    """Train ``base_path`` on ``texts`` (AdamW) and save a new checkpoint to ``out_dir``.

    Each step takes ``batch_size`` texts in a seeded shuffled order (all of them when None); a progress
    bar labelled ``desc`` shows the steps. With ``stop_margin`` (full batches only), training stops as
    soon as every trained token is the model's top choice by at least that many logits, so greedy
    decoding replays the texts; ``steps`` is then the most it may take. Returns ``out_dir``. If it already holds a checkpoint, nothing
    is trained (callers key the directory by what they train on). Safe when several processes build the
    same directory.
    """
    return build_once(
        Path(out_dir),
        lambda directory: _train(base_path, texts, directory, steps, lr, seed, batch_size, desc, stop_margin),
    )


def _train(
    base_path: str,
    texts: list[str],
    directory: Path,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int | None,
    desc: str,
    stop_margin: float | None,
) -> None:
    if stop_margin is not None and batch_size:
        raise ValueError("stop_margin needs full batches (batch_size=None): it judges every text at once")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = tokenizer.encode("<|im_start|>assistant\n")
    encoded = [tokenizer.encode(text) for text in texts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        mask = assistant_token_mask(ids, header, end_id)
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    if batch_size:
        order = torch.cat([torch.randperm(len(encoded)) for _ in range(steps * batch_size // len(encoded) + 1)])
    for step in tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True):
        rows = order[step * batch_size : (step + 1) * batch_size] if batch_size else torch.arange(len(encoded))
        width = int(attention[rows].sum(-1).max())
        output = model(
            input_ids=input_ids[rows, :width], attention_mask=attention[rows, :width], labels=labels[rows, :width]
        )
        if stop_margin is not None and _smallest_margin(output.logits, labels[rows, :width]) >= stop_margin:
            break
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
    model.eval()

    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _smallest_margin(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The smallest lead of a trained token's logit over the best other token (negative: a wrong top choice)."""
    logits, labels = logits[:, :-1].detach(), labels[:, 1:]
    trained = labels != -100
    scores = logits[trained]
    target = labels[trained]
    chosen = scores.gather(-1, target[:, None])[:, 0]
    runner_up = scores.scatter(-1, target[:, None], float("-inf")).max(-1).values
    return float((chosen - runner_up).min())


def finetune_chats(
    base_path: str,
    chats: list[list[dict[str, Any]]],
    out_dir: str,
    *,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
    batch_size: int = 16,
    desc: str = "fine-tuning",
) -> str:
    """``finetune`` for a vision-language model: train ``base_path`` on chat conversations whose messages may
    carry images (content parts ``{"type": "image", "image": <PIL image, bytes, path...>}``, see
    ``agentloop.images``) and save a new checkpoint (model, tokenizer, image processor) to ``out_dir``.

    Each conversation is rendered and its images laid into the ids exactly as a rollout does (one pad per image,
    expanded to the image's size); the loss is on assistant tokens, with the vision special tokens out of the
    softmax as the engines and the trainer keep them. Deterministic for a seed; nothing is trained when
    ``out_dir`` already holds a checkpoint (callers key it by what they train on). Returns ``out_dir``.
    """
    return build_once(
        Path(out_dir), lambda directory: _train_chats(base_path, chats, directory, steps, lr, seed, batch_size, desc)
    )


def _train_chats(
    base_path: str,
    chats: list[list[dict[str, Any]]],
    directory: Path,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int,
    desc: str,
) -> None:
    torch.manual_seed(seed)
    processor = load_processor(base_path)
    if processor is None:
        raise ValueError(f"finetune_chats: {base_path} is not a vision-language model; use finetune for text")
    tokenizer = processor.tokenizer
    model = model_class(base_path).from_pretrained(base_path, dtype=torch.float32)
    pad_id = int(model.config.image_token_id)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    header = tokenizer.encode("<|im_start|>assistant\n")
    samples = [
        _encode_chat(processor, chat, pad_id, header, end_id, f"finetune_chats: conversation {i}")
        for i, chat in enumerate(chats)
    ]

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    order = torch.cat([torch.randperm(len(samples)) for _ in range(steps * batch_size // len(samples) + 1)])
    for step in tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True):
        inputs, labels = _collate(
            model, [samples[int(i)] for i in order[step * batch_size : (step + 1) * batch_size]], tokenizer.pad_token_id
        )
        logits = without_vision_tokens(model(**inputs).logits, model.config)  # as the trainer scores
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    processor.image_processor.save_pretrained(
        directory
    )  # the joined processor itself cannot be saved without torchvision


def _encode_chat(
    processor: Any, chat: list[dict[str, Any]], pad_id: int, header: list[int], end_id: int, where: str
) -> tuple[list[int], list[int], list[ProcessedImage]]:
    """A conversation's expanded ids, its assistant-token mask and its processed images."""
    messages, images = split_images(chat, None, where)
    processed = process_images(processor, images, where)
    ids = expand_image_pads(
        processor.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False), processed, pad_id, where
    )
    return ids, assistant_token_mask(ids, header, end_id), processed


def _collate(
    model: Any, samples: list[tuple[list[int], list[int], list[ProcessedImage]]], pad_token_id: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """Right-padded model inputs for ``samples`` (images concatenated in order, M-RoPE positions) and labels."""
    width = max(len(ids) for ids, _, _ in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for row, (ids, mask, _) in enumerate(samples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention}
    images = [image for _, _, processed in samples for image in processed]
    if images:
        inputs.update(image_inputs(images))
    inputs["position_ids"] = mrope_positions(
        model, input_ids, inputs.get("image_grid_thw"), attention
    )  # as the rollout's batches
    return inputs, labels
