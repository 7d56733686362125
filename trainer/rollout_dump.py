"""``trainer.rollout_data_dir``: every sample's text, score and dataset index, one JSONL file per step."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from agentloop.batch import RolloutBatch


def dump_rollouts(
    directory: str | Path, step: int, rollout: RolloutBatch, scores: torch.Tensor, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Write ``directory/<step>.jsonl``: per sample its step, dataset index, prompt and response text, and score."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    tensors, indices = rollout.batch, rollout.non_tensor_batch["index"]
    with open(Path(directory) / f"{step}.jsonl", "w") as file:
        for i in range(len(rollout)):
            prompt = tensors["prompts"][i][tensors["attention_mask"][i, : tensors["prompts"].shape[1]].bool()]
            response = tensors["responses"][i][tensors["attention_mask"][i, tensors["prompts"].shape[1] :].bool()]
            record = {
                "step": step,
                "index": indices[i],
                "input": tokenizer.decode(prompt),
                "output": tokenizer.decode(response),
                "score": float(scores[i].sum()),
            }
            file.write(json.dumps(record) + "\n")
