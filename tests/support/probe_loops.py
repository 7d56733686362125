"""Agent loops used by the tests to observe the stack from inside a trajectory."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from agentloop import AgentLoopBase, AgentLoopOutput, register
from agentloop.protocol import Segment


@register("probe_multi_turn")
class MultiTurnProbe(AgentLoopBase):
    """Three model turns separated by a fixed observation; records the server and cache hits per turn."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        prompt_ids = self.encode_prompt(row["prompt"])
        observation = self.tokenizer.encode("\n<tool_response>\nok\n</tool_response>\n")
        params = {**sampling_params, "max_new_tokens": 4, "ignore_eos": True}
        response, mask, logprobs, servers, cached = [], [], [], [], []
        for turn in range(3):
            if turn:
                response += observation
                mask += [0] * len(observation)
                logprobs += [0.0] * len(observation)
            output = await self.server_manager.generate(row["request_id"], prompt_ids + response, params)
            servers.append(self.server_manager.server_of(row["request_id"]))
            response += output.token_ids
            mask += [1] * len(output.token_ids)
            logprobs += output.log_probs
            cached.append(output.cached_tokens)
        return AgentLoopOutput(
            prompt_ids,
            response,
            mask,
            logprobs,
            num_turns=6,
            extra_fields={"servers": servers, "cached": cached, "observation": observation},
        )


@register("probe_edits_row")
class RowEditingProbe(AgentLoopBase):
    """One model turn, after editing its row in place: appends to the prompt, marks ``extra_info``."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        row["prompt"].append({"role": "user", "content": "edited"})
        row["extra_info"]["edited"] = True
        prompt_ids = self.encode_prompt(row["prompt"])
        output = await self.server_manager.generate(row["request_id"], prompt_ids, sampling_params)
        return AgentLoopOutput(prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs)


@register("probe_fails")
class FailingProbe(AgentLoopBase):
    """One model turn, or a bug: raises when the row's ``extra_info.fail`` is set (after its first turn); with
    ``fail: empty_last_segment`` it returns that turn as a closed segment and a reward of 1.0 on an empty last one
    (the record a rewrite that never got its reply left)."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        prompt_ids = self.encode_prompt(row["prompt"])
        output = await self.server_manager.generate(row["request_id"], prompt_ids, sampling_params)
        fail = (row.get("extra_info") or {}).get("fail")
        if fail == "empty_last_segment":
            answered = Segment(prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs)
            return AgentLoopOutput(prompt_ids, [], [], [], reward_score=1.0, segments=[answered])
        if fail:
            raise ValueError(f"probe bug on dataset index {row['index']}")
        return AgentLoopOutput(prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs)


@register("probe_exits_once")
class WorkerKillingProbe(AgentLoopBase):
    """One model turn; the first sample whose row names a marker file that does not exist yet creates it and
    kills its own worker process (a worker dying mid-batch), once; a row with ``extra_info.always_exit`` kills
    it every time (a sample that crashes its process)."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        prompt_ids = self.encode_prompt(row["prompt"])
        output = await self.server_manager.generate(row["request_id"], prompt_ids, sampling_params)
        extra = row.get("extra_info") or {}
        if extra.get("always_exit"):
            os._exit(1)
        marker = extra.get("exit_marker")
        if marker and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return AgentLoopOutput(prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs)


@register("probe_chaos")
class ChaosProbe(AgentLoopBase):
    """Two model turns; between them, once per marker file, a row's ``extra_info.chaos`` kills the server its
    session is on (``server``), stops that server's process (``stop``) or kills its own worker (``worker``)."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        import ray

        prompt_ids = self.encode_prompt(row["prompt"])
        params = {**sampling_params, "max_new_tokens": 4}
        first = await self.server_manager.generate(row["request_id"], prompt_ids, params)
        extra = row.get("extra_info") or {}
        marker = extra.get("chaos_marker")
        if extra.get("chaos") and marker and not os.path.exists(marker):
            open(marker, "w").close()
            if extra["chaos"] == "worker":
                os._exit(1)
            server = self.server_manager.servers[self.server_manager.server_of(row["request_id"])]
            if extra["chaos"] == "stop":  # the server's process stops, as a wedged engine or GPU behaves
                os.kill((await server.node_info.remote())["pid"], signal.SIGSTOP)
            else:
                ray.kill(server)
        second = await self.server_manager.generate(row["request_id"], prompt_ids + first.token_ids, params)
        ids = first.token_ids + second.token_ids
        # learned in a step or two by the "yes or no" test model (tests/support/models.build_coin_model)
        reward = float(ids[:1] == self.tokenizer.encode("yes"))
        # only the answer is trained: the second turn's tokens are there to be interrupted, not learned
        mask = [1] * len(first.token_ids) + [0] * len(second.token_ids)
        return AgentLoopOutput(
            prompt_ids, ids, mask, first.log_probs + second.log_probs, num_turns=3, reward_score=reward
        )


_ARRIVALS: dict[tuple[str, int, str], asyncio.Event] = {}


def _arrival(batch: str, index: int, what: str) -> asyncio.Event:
    return _ARRIVALS.setdefault((batch, index, what), asyncio.Event())


@register("probe_ordered_turn")
class OrderedTurnProbe(AgentLoopBase):
    """One turn of exactly ``extra_info.length`` tokens (eos ignored) arriving in a set order without wall-clock
    delays: sample ``extra_info.index`` of ``extra_info.batch`` starts once sample ``index - 1`` was counted in
    flight on its server (``extra_info.after="placed"``) or has finished (``"finished"``). The samples of a batch
    must share one worker. Records the index of its server in ``extra_fields["server"]``."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        info = row["extra_info"]
        batch, index = info["batch"], int(info["index"])
        if index:
            await _arrival(batch, index - 1, info["after"]).wait()
        prompt_ids = self.encode_prompt(row["prompt"])
        params = {**sampling_params, "max_new_tokens": info["length"], "ignore_eos": True}
        turn = asyncio.ensure_future(self.server_manager.generate(row["request_id"], prompt_ids, params))
        await asyncio.sleep(0)  # the turn runs up to its dispatch, which counts it in flight on its server
        _arrival(batch, index, "placed").set()
        try:
            output = await turn
        finally:
            _arrival(batch, index, "finished").set()
        server = self.server_manager.server_of(row["request_id"])
        return AgentLoopOutput(
            prompt_ids, output.token_ids, [1] * len(output.token_ids), output.log_probs, extra_fields={"server": server}
        )
