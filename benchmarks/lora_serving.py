"""A LoRA adapter in the ``hf`` engine: merged into its copy of the base weights (what the engine does) or served as
an adapter (peft's LoRA layers beside the frozen base weights), measured in one process.

    python -m benchmarks.lora_serving [--model tiny|real] [--rank 16] [--batch 4] [--new-tokens 32]

Both models hold the same base and the same adapter (rank ``--rank`` on every linear layer, random factors; peft
starts ``lora_B`` at zero, which would make the adapter a no-op). Measured: greedy decoding of ``--batch`` prompts
(transformers' ``generate``, the engine's dtype: float32 for the tiny model, bf16 at the 0.6B shape) in new tokens
per second, and a push: for the merged model the engine's own merge (``PackedAdapter.merged_into`` of the kept base
weights, copied into the model, as ``HFEngine.update_adapter``), for the adapter its factors copied into the LoRA
layers. Both hold the same policy: the share of equal greedy tokens is reported beside.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from agentloop.models.tiny_qwen import tiny_model_path
from benchmarks.real_size import real_size_model_path
from trainer.lora import gather_adapter, pack_adapter


def adapted(model_path: str, dtype: torch.dtype, rank: int) -> Any:
    """The base with a LoRA adapter of ``rank`` on every linear layer, its factors random (seeded)."""
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model.eval()


def decode(model: Any, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy tokens and seconds for ``new_tokens`` new tokens per prompt."""
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(
            prompts, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0
        )
    return output[:, prompts.shape[1] :], time.perf_counter() - start


def measure(model_path: str, dtype: torch.dtype, rank: int, batch: int, new_tokens: int) -> dict[str, Any]:
    served = adapted(model_path, dtype, rank)
    adapter = pack_adapter(served, gather_adapter(served))
    merged = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    params = dict(merged.named_parameters())
    base = {f"{module}.weight": params[f"{module}.weight"].detach().clone() for module in adapter.scalings}

    start = time.perf_counter()  # the engine's push: merge into the kept base weights, copy into the model
    with torch.no_grad():
        for name, tensor in adapter.merged_into(base).items():
            params[name].copy_(tensor)
    merged_push_s = time.perf_counter() - start
    factors = {name: tensor.clone() for name, tensor in adapter.weights.tensors().items()}
    start = time.perf_counter()  # the adapter's push: its factors into the LoRA layers
    set_peft_model_state_dict(served, factors)
    adapter_push_s = time.perf_counter() - start

    prompts = torch.randint(1, 1000, (batch, 64), generator=torch.Generator().manual_seed(1))
    decode(merged, prompts[:, :8], 2), decode(served, prompts[:, :8], 2)  # warm-up
    merged_tokens, merged_s = decode(merged, prompts, new_tokens)
    served_tokens, served_s = decode(served, prompts, new_tokens)
    return {
        "adapter_mb": round(sum(t.numel() * t.element_size() for t in factors.values()) / 1e6, 1),
        "merged_tokens_per_s": round(batch * new_tokens / merged_s, 1),
        "adapter_tokens_per_s": round(batch * new_tokens / served_s, 1),
        "merged_push_s": round(merged_push_s, 3),
        "adapter_push_s": round(adapter_push_s, 3),
        "equal_greedy_tokens": round(float((merged_tokens == served_tokens).float().mean()), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.model == "real":
        model_path, dtype = real_size_model_path(), torch.bfloat16
    else:
        model_path, dtype = tiny_model_path(), torch.float32
    result = measure(model_path, dtype, args.rank, args.batch, args.new_tokens)
    print(json.dumps({args.model: result}), flush=True)


if __name__ == "__main__":
    main()
