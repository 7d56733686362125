"""The quick start's judged reward (``config/arithmetic_grpo_judge.yaml``): a frozen judge model grades the final answer.

The judge is the tiny model taught to grade an answer against the reference answer, as an LLM judge is asked with
a reference: "Question: 3 + 4 = ? Reference: 7. Answer: 7. Correct?" -> ``yes`` or ``no``
(``judge_path`` trains it on first use and caches it; it never sees the policy's problems, only pairs of numbers).
The reward is 1 when the judge says yes. The answer it grades is the last number of the response (the
``submit_answer`` argument, or the number a plain-text answer ends with); a response without a number scores 0
without a judge call. A judge reply that reads as neither yes nor no fails the sample (``JudgeUnparsable``, the
reply recorded), unless ``fallback=rule`` (``reward_kwargs``): then the rule decides and ``judge_parsed`` says so.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Any

from transformers import AutoTokenizer

from agentloop.judge import Judge, JudgeUnparsable
from agentloop.models.cache import cache_root
from agentloop.models.sft import finetune
from agentloop.models.tiny_qwen import tiny_model_path

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def judge_messages(question: str, reference: str, answer: str) -> list[dict[str, str]]:
    """What the judge is asked about one answer."""
    return [{"role": "user", "content": f"{question}\nReference: {reference}\nAnswer: {answer}\nCorrect?"}]


def read_verdict(text: str) -> float:
    """1.0 for a reply that starts with yes, 0.0 for no; anything else is unparsable."""
    word = text.strip().lower()
    if word.startswith("yes"):
        return 1.0
    if word.startswith("no"):
        return 0.0
    raise JudgeUnparsable(text, "expected a reply starting with yes or no")


async def judged_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    judge: Judge,
    fallback: str = "fail",
    **kwargs: Any,
) -> dict[str, float]:
    """The judge's grade of the response's final answer (see the module docstring)."""
    numbers = _NUMBER.findall(solution_str)
    if not numbers:
        return {"score": 0.0, "answer_found": 0.0, "judge_parsed": 1.0}
    question = f"Question: {(extra_info or {}).get('expression', '?')} = ?"
    try:
        grade = await judge.grade(judge_messages(question, str(ground_truth), numbers[-1]), read_verdict)
    except JudgeUnparsable:
        if fallback != "rule":
            raise
        correct = abs(float(numbers[-1]) - float(ground_truth)) < 1e-6
        return {"score": float(correct), "answer_found": 1.0, "judge_parsed": 0.0}
    return {"score": grade, "answer_found": 1.0, "judge_parsed": 1.0}


def judge_path(examples: int = 3000, seed: int = 0) -> str:
    """The judge's checkpoint: the tiny model fine-tuned on ``examples`` graded answers (half right), cached."""
    base = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(seed)
    texts = []
    for _ in range(examples):
        a, b, op = rng.randint(0, 12), rng.randint(0, 12), rng.choice("+-*")
        truth = {"+": a + b, "-": a - b, "*": a * b}[op]
        right = rng.random() < 0.5
        # wrong answers near the truth as often as far from it: the judge must compare, not guess by size
        wrong = truth + rng.choice([-1, 1]) * rng.randint(1, 3) if rng.random() < 0.5 else rng.randint(-99, 999)
        answer = truth if right or wrong == truth else wrong
        chat = judge_messages(f"Question: {a} {op} {b} = ?", str(truth), str(answer))
        chat.append({"role": "assistant", "content": "yes" if answer == truth else "no"})
        texts.append(tokenizer.apply_chat_template(chat, tokenize=False))
    training = dict(steps=3000, lr=2e-3, batch_size=32, seed=seed)
    key = hashlib.sha256(json.dumps([base, texts, training]).encode()).hexdigest()[:16]
    return finetune(
        base,
        texts,
        str(cache_root() / "models" / f"arithmetic-judge-{key}"),
        **training,
        desc="arithmetic judge (first run only): grading answers against the reference",
    )
