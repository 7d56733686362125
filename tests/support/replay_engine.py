"""``ReplayEngine``: a test engine, plugged in by the engine contract, that replays scripted model turns.

No model can be made to write arbitrary text on demand, so for the fuzz test this engine answers a
session's first turn with the hostile output the prompt names (a user message ``fuzz case <i>``
indexes ``hostile_outputs()``) and every later turn with ``Done.`` (or an abort before the first token). Everything else about it is what
an engine does: token ids from the model's real tokenizer, one log-prob per token, the sampling keys
validated, generation stopped at the first end-of-turn (or stop) token or cut at ``max_new_tokens``
with ``finish_reason="length"``. Select it with
``actor_rollout_ref.rollout.name=tests.support.replay_engine.ReplayEngine``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Mapping

import torch
from transformers import AutoTokenizer

from agentloop.protocol import TokenOutput
from agentloop.server.sampling import validate_sampling_params
from tests.support.hostile_outputs import HostileOutput, hostile_outputs
from agentloop.settings import ServerSettings

CASE = re.compile(r"fuzz case (\d+)")
LAST_TURN = "Done."
THEN_ABORT = ", then abort"
LOG_PROB = -0.25  # any finite value: the loop only carries it through
# tokens of this tokenizer hold at most a few characters; cutting a megabyte-long output to this many
# characters per allowed token before encoding keeps a turn's cost bounded (see _encode)
CHARS_PER_TOKEN_BOUND = 8


def fuzz_prompt(index: int, then_abort: bool = False) -> list[dict[str, str]]:
    """The chat prompt that makes the engine replay hostile output ``index``; ``then_abort``: its later turns are
    aborted before their first token (as an engine aborts a request it has just taken)."""
    return [{"role": "user", "content": f"fuzz case {index}" + (THEN_ABORT if then_abort else "")}]


class ReplayEngine:
    """Replays ``hostile_outputs()`` by prompt; implements ``agentloop.server.engine.Engine``."""

    http_url = None  # the rollout server hosts the HTTP front
    last_turn = LAST_TURN  # every turn of a session after its first

    def __init__(self, model_path: str, cases: list[HostileOutput]) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.cases = cases
        self.turns: Counter[str] = Counter()  # model turns served per session (request id)
        self.sleeping = False

    @classmethod
    def from_settings(cls, settings: ServerSettings, rank: int) -> ReplayEngine:
        return cls(settings.model_path, hostile_outputs())

    def script(self, prompt_ids: list[int], request_id: str) -> str:
        """The text of this session's next turn."""
        match = CASE.search(self.tokenizer.decode(prompt_ids))
        turn = self.turns[request_id]
        self.turns[request_id] += 1
        if match is None or turn > 0:
            return self.last_turn
        return self.cases[int(match.group(1))].text

    def _encode(self, text: str, max_new_tokens: int) -> list[int]:
        """Token ids of the text, enough of them to fill ``max_new_tokens`` (megabyte outputs are cut first)."""
        limit = CHARS_PER_TOKEN_BOUND * max_new_tokens
        ids = self.tokenizer.encode(text[:limit], add_special_tokens=False)
        if len(text) > limit and len(ids) <= max_new_tokens:  # unusually long tokens: encode it all
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str) -> TokenOutput:
        params = validate_sampling_params(sampling_params)
        if self.sleeping:
            raise RuntimeError("ReplayEngine is asleep: wake_up() first")
        max_new = int(params["max_new_tokens"])
        if self.turns[request_id] and THEN_ABORT in self.tokenizer.decode(prompt_ids):
            return TokenOutput([], [], "abort")
        ids = self._encode(self.script(prompt_ids, request_id), max_new) + [self.tokenizer.eos_token_id]
        stops = set(params["stop_token_ids"] or []) | (set() if params["ignore_eos"] else {self.tokenizer.eos_token_id})
        end = next((i + 1 for i, token in enumerate(ids) if token in stops), len(ids))
        ids, finish = (ids[:end], "stop") if end <= max_new else (ids[:max_new], "length")
        return TokenOutput(ids, [LOG_PROB] * len(ids), finish)

    async def abort(self, request_id: str) -> int:
        return 0  # every request is answered at once: nothing is ever in flight to abort

    async def update_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> int:
        return len(named_tensors)  # replayed text does not depend on weights

    async def update_adapter(self, adapter: Any) -> int:
        return len(adapter.scalings)  # likewise

    async def update_weights_from_disk(self, model_path: str) -> None:
        return None

    async def sleep(self) -> None:
        self.sleeping = True

    async def wake_up(self) -> None:
        self.sleeping = False

    async def flush_cache(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    @property
    def num_in_flight(self) -> int:
        return 0

    @property
    def is_sleeping(self) -> bool:
        return self.sleeping
