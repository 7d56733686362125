"""Reward functions and an environment that call the judge (``reward_model.*``), for the judge tests. The judge is
the coin model: asked "question N", it answers yes or no."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import aiohttp
from openai.types.chat import ChatCompletion
from transformers import PreTrainedTokenizerBase

from agentloop.envs import BaseEnv
from agentloop.judge import Judge, JudgeUnparsable


def question(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {index}"}]


async def ask_the_judge(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, *, judge: Judge, **kwargs: Any
) -> dict[str, Any]:
    """1 when the judge says yes to the row's question; its text goes to reward_extra_info."""
    text = await judge.chat(question(extra_info["index"]))
    return {"score": float(text.startswith("yes")), "judge_text": text}


def judged(text: str, prompt_ids: list[int], address: str) -> dict[str, Any]:
    """The reward of a yes, with what the GenRM tests check: the judge's text, the prompt's length by
    ``reward_model_tokenizer`` and the address called."""
    score = float(text.startswith("yes"))
    return {"score": score, "judge_text": text, "prompt_tokens": len(prompt_ids), "address": address}


def prompt_ids(tokenizer: PreTrainedTokenizerBase, index: int) -> list[int]:
    """Question ``index`` as the judge is asked it: its chat template with the generation prompt."""
    return list(tokenizer.apply_chat_template(question(index), add_generation_prompt=True, return_dict=False))


async def verl_genrm(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict,
    reward_router_address: str,
    reward_model_tokenizer: PreTrainedTokenizerBase,
) -> dict[str, Any]:
    """A GenRM reward function as verl's reward loop calls one (its docs' ``compute_score_gsm8k``): the judge asked over
    HTTP at ``f"http://{reward_router_address}/v1/chat/completions"``, the reply read as an OpenAI ``ChatCompletion``.
    Asks for more tokens than the judge's budget, as verl's example does (4096)."""
    messages = question(extra_info["index"])
    async with aiohttp.ClientSession() as session:
        request = {"messages": messages, "temperature": 0.0, "max_tokens": 4096}
        async with session.post(f"http://{reward_router_address}/v1/chat/completions", json=request) as response:
            response.raise_for_status()
            completion = ChatCompletion.model_validate(await response.json())
    ids = prompt_ids(reward_model_tokenizer, extra_info["index"])
    return judged(completion.choices[0].message.content, ids, reward_router_address)


def verl_genrm_sync(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, **kwargs: Any
) -> dict[str, Any]:
    """The same through SGLang's ``/generate`` from a plain function (run in a thread), ids in and text out."""
    address, ids = kwargs["reward_router_address"], prompt_ids(kwargs["reward_model_tokenizer"], extra_info["index"])
    body = json.dumps({"input_ids": ids, "sampling_params": {"temperature": 0.0}}).encode()
    request = urllib.request.Request(f"http://{address}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return judged(json.load(response)["text"], ids, address)


async def impatient(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, judge: Judge) -> float:
    """A judge call that cannot finish in time: a long reply within a millisecond."""
    await judge.chat(question(extra_info["index"]), timeout_s=0.001, max_new_tokens=64, ignore_eos=True)
    return 1.0


def read_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise JudgeUnparsable(text, "expected a number") from None


async def wants_a_number(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, judge: Judge
) -> float:
    """A grade read as a number from a judge that says yes or no: unparsable."""
    return await judge.grade(question(extra_info["index"]), read_number)


class JudgedEnv(BaseEnv):
    """Each turn is graded by the judge (question <turn>): its yes is the turn's reward, its text the observation."""

    def reset(self) -> None:
        self.turn = 0

    async def step(self, response_text: str) -> tuple[str, bool, dict[str, Any]]:
        self.turn += 1
        text = await self.judge.chat(question(self.turn))
        return f"the judge says {text}", self.turn == 2, {"reward": float(text.startswith("yes"))}
