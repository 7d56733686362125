"""Fuzz: about a thousand hostile model outputs through the parsers and through the whole tool loop.

The loop runs for real (a ``RolloutServer`` actor on a local Ray, the ``Router``, ``ToolAgentLoop``,
the tools of ``scripted_tools.yaml``, the tiny model's tokenizer and chat template); only the engine
is a test engine, plugged in by the engine contract, that replays the outputs
(``tests/support/replay_engine.py``). Every output must come back without an exception and in bounded
time, with each tool observation cut to ``max_tool_response_length``, at most ``max_parallel_calls``
calls run per turn, and every faulty call counted under its kind.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import Counter

import jsonschema
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from agentloop import AgentLoopManager
from agentloop.agent_loop.tool_agent import ToolAgentLoop
from agentloop.agent_loop.trajectory import observation_delta
from agentloop.dumps import mask_runs
from agentloop.dumps import write_rollout_dump
from agentloop.protocol import AgentLoopOutput
from agentloop.turn_totals import tool_errors_by_kind
from agentloop.router import Router
from agentloop.server.engine import Engine
from agentloop.tools.parsers import get_parser
from agentloop.tools.schemas import ToolCall
from agentloop.tools.toolset import argument_validator, checked_arguments, load_tool_set
from tests.support.config import small_config
from tests.support.hostile_outputs import HostileOutput, hostile_outputs
from tests.support.models import TOOLS_PATH
from tests.support.replay_engine import LOG_PROB, ReplayEngine, fuzz_prompt

CASES = hostile_outputs()
LIMIT = 64  # multi_turn.max_tool_response_length
MAX_CALLS = 4  # multi_turn.max_parallel_calls
RESPONSE_LENGTH = 8192  # room for a hundred calls in one turn
SIDES = ("left", "right", "middle")  # tool_response_truncate_side, one per case in turn
PARSE_BOUND_S = 2.0  # per output and parser; a backtracking regex took over a minute on a bomb
HANG_BOUND_S = 60.0  # per trajectory, waiting for its turn among the concurrent ones included
CONCURRENCY = 32
MARKER = "...(truncated)..."  # the longest of the three sides' markers
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}


def fuzz_config(model_path: str, side: str):
    return small_config(
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.rollout.name=tests.support.replay_engine.ReplayEngine",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS_PATH}",
        f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={LIMIT}",
        f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side={side}",
        f"actor_rollout_ref.rollout.multi_turn.max_parallel_calls={MAX_CALLS}",
        "data.max_prompt_length=768",
        f"data.max_response_length={RESPONSE_LENGTH}",
    )


def test_the_outputs_cover_every_kind_of_hostility():
    categories = Counter(case.category for case in CASES)
    assert len(CASES) == 1000 and len(categories) == 20
    assert hostile_outputs() == CASES, "the generator must be deterministic"
    assert max(len(case.text) for case in CASES) >= 1_000_000
    assert max(len(case.faults or ()) for case in CASES) >= 100


def test_replay_engine_keeps_the_engine_contract():
    for member, declared in vars(Engine).items():
        if inspect.iscoroutinefunction(declared):
            assert inspect.iscoroutinefunction(getattr(ReplayEngine, member)), member
        elif isinstance(declared, property):
            assert isinstance(inspect.getattr_static(ReplayEngine, member), property), member
    assert isinstance(inspect.getattr_static(ReplayEngine, "from_settings"), classmethod)


@pytest.mark.parametrize("format", ["hermes", "qwen3_coder"])
def test_parsers_return_quickly_on_every_hostile_output(format):
    parse = get_parser(format)
    crashes, slow, malformed, miscounted = [], [], [], []
    for index, case in enumerate(CASES):
        start = time.perf_counter()
        try:
            content, calls = parse(case.text)
        except Exception as error:  # noqa: BLE001 - every exception is a finding
            crashes.append((index, case.category, repr(error)[:200]))
            continue
        seconds = time.perf_counter() - start
        if seconds > PARSE_BOUND_S:
            slow.append((index, case.category, round(seconds, 2)))
        if not isinstance(content, str) or not all(well_formed(call) for call in calls):
            malformed.append((index, case.category, [repr(call)[:200] for call in calls if not well_formed(call)][:1]))
        if format == "hermes" and case.faults is not None:
            seen = ["parse_error" if call.error else "parsed" for call in calls]
            meant = ["parse_error" if fault == "parse_error" else "parsed" for fault in case.faults]
            if seen != meant:
                miscounted.append((index, case.category, seen[:5], meant[:5]))
    assert not crashes, crashes[:10]
    assert not slow, slow[:10]
    assert not malformed, malformed[:10]
    assert not miscounted, miscounted[:10]


def well_formed(call: ToolCall) -> bool:
    """A fault with a short message, or a name and an object of arguments that are valid text throughout."""
    if call.error is not None:
        return len(call.error) <= 1000
    try:  # what a rollout dump or an HTTP response does with a call
        json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False).encode("utf-8")
    except ValueError:
        return False
    return isinstance(call.name, str) and isinstance(call.arguments, dict)


def test_tool_texts_are_valid_text_whatever_the_tool_returns():
    tool_set = load_tool_set(TOOLS_PATH)
    call = ToolCall(name="echo", arguments={"text": "a\ud800b", "times": 2})  # as any client may build one
    result = asyncio.run(tool_set.call(call, "surrogates", {}, {}))
    assert result.error is None and result.text == "a?ba?b"


# ---------------------------------------------------------------------------------- the tool loop


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def manager(local_ray, model_path):
    config = fuzz_config(model_path, "middle")
    config.actor_rollout_ref.rollout.http.enable = False
    manager = AgentLoopManager(config)
    yield manager
    manager.shutdown()


@pytest.fixture(scope="module")
def replay_server(manager):
    """The manager's rollout server, which the loops below drive through routers of their own."""
    return manager.servers[0]


async def run_all(router: Router, tokenizer, model_path: str) -> list[tuple[AgentLoopOutput | BaseException, float]]:
    """Every case's trajectory, a few dozen at a time, each bounded by HANG_BOUND_S."""
    configs = {side: fuzz_config(model_path, side) for side in SIDES}
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(index: int) -> tuple[AgentLoopOutput | BaseException, float]:
        async with gate:
            loop = ToolAgentLoop(server_manager=router, tokenizer=tokenizer, config=configs[SIDES[index % 3]])
            row = {"prompt": fuzz_prompt(index), "agent_name": "tool_agent", "request_id": f"fuzz-{index}"}
            start = time.perf_counter()
            try:
                output = await asyncio.wait_for(loop.run(dict(GREEDY), **row), HANG_BOUND_S)
            except BaseException as error:  # noqa: BLE001 - a crash or a hang is a finding, reported below
                output = error
            return output, time.perf_counter() - start

    return await asyncio.gather(*(one(index) for index in range(len(CASES))))


def expected_fault(call, tool_set) -> str | None:
    """The fault a parsed call must be counted as before any tool runs; None when a tool gets to run it."""
    if call.error is not None:
        return "parse_error"
    tool = tool_set.tools.get(call.name)
    if tool is None:
        return "unknown_tool"
    schema = tool.tool_schema.function.parameters.model_dump(exclude_none=True)
    try:  # arguments that fail only by a lossless type are converted (pinned in test_verl_rewards_and_code)
        checked_arguments(call.arguments, argument_validator(schema))
        return None
    except jsonschema.ValidationError:
        return "invalid_arguments"


def check_trajectory(case: HostileOutput, output: AgentLoopOutput, tokenizer, tool_set, bounds) -> list[str]:
    """What is wrong with one trajectory (nothing, ideally)."""
    problems = []
    mask, ids, turns = output.response_mask, output.response_ids, output.turns
    errors = tool_errors_by_kind(turns)
    if len(ids) > RESPONSE_LENGTH or (mask and mask[-1] != 1):
        problems.append(f"{len(ids)} response tokens, ending on mask {mask[-1:]}")
    if any(lp != (LOG_PROB if m else 0.0) for lp, m in zip(output.response_logprobs, mask)):
        problems.append("log-probs do not follow the mask")
    # observations: one span per turn that ran tools, each within the limit per tool message
    spans = mask_runs(mask)
    observed = [end - start for value, start, end in spans if value == 0]
    with_observation = [turn for turn in turns if turn.observation_tokens]
    if observed != [turn.observation_tokens for turn in with_observation]:
        problems.append(f"observation spans {observed} vs turns {[t.observation_tokens for t in with_observation]}")
    for length, turn in zip(observed, with_observation):
        messages = turn.tool_calls + (1 if turn.dropped_calls else 0)
        if length > bounds(messages):
            problems.append(f"observation of {length} tokens for {messages} tool messages (bound {bounds(messages)})")
    # calls: what the parser finds in the first model turn, capped, each counted under its kind
    first = ids[spans[0][1] : spans[0][2]] if spans else []
    stopped = bool(first) and first[-1] == tokenizer.eos_token_id
    calls = get_parser("hermes")(tokenizer.decode(first[:-1] if stopped else first, skip_special_tokens=False))[1]
    ran = bool(turns[0].calls)
    if ran != (stopped and bool(calls)):
        problems.append(f"tools ran: {ran}, turn stopped: {stopped}, calls parsed: {len(calls)}")
    if ran:
        records = turns[0].calls
        executed, dropped = calls[:MAX_CALLS], max(0, len(calls) - MAX_CALLS)
        if turns[0].tool_calls != len(executed) or turns[0].dropped_calls != dropped or len(records) != len(calls):
            problems.append(f"{len(calls)} calls: {turns[0].tool_calls} run, {turns[0].dropped_calls} dropped")
        for call, record in zip(executed, records):
            meant = expected_fault(call, tool_set)
            if record.error != meant and not (meant is None and record.error in (None, "exception", "timeout")):
                problems.append(f"call {call.name!r:.40} counted as {record.error}, expected {meant}")
        if any(record.error != "too_many_calls" for record in records[len(executed) :]):
            problems.append("dropped calls not counted as too_many_calls")
        if stopped and case.faults is not None:
            meant = Counter(f for f in case.faults[:MAX_CALLS] if f) + Counter(
                too_many_calls=max(0, len(case.faults) - MAX_CALLS)
            )
            if Counter(errors) != meant:
                problems.append(f"tool_errors {errors}, the generator meant {dict(meant)}")
    counted = Counter(record.error for turn in turns for record in turn.calls if record.error)
    if Counter(errors) != counted or output.metrics["tool_errors"] != sum(counted.values()):
        problems.append(f"tool_errors {errors} vs per-call records {dict(counted)}")
    return problems


def test_tool_loop_survives_every_hostile_output(replay_server, tokenizer, model_path):
    tool_set = load_tool_set(TOOLS_PATH)
    marker = len(tokenizer.encode(MARKER, add_special_tokens=False))
    wrapping = {
        m: len(observation_delta(tokenizer, [{"role": "tool", "content": ""}] * m)) for m in range(1, MAX_CALLS + 2)
    }

    def bounds(messages: int) -> int:
        return wrapping[messages] + messages * (LIMIT + marker)

    start = time.perf_counter()
    results = asyncio.run(run_all(Router([replay_server], request_timeout_s=30), tokenizer, model_path))
    elapsed = time.perf_counter() - start

    crashes, hangs, problems = [], [], []
    for index, ((output, seconds), case) in enumerate(zip(results, CASES)):
        if isinstance(output, asyncio.TimeoutError):
            hangs.append((index, case.category, round(seconds, 1)))
        elif isinstance(output, BaseException):
            crashes.append((index, case.category, f"{type(output).__name__}: {str(output)[:300]}"))
        else:
            problems += [
                (index, case.category, problem)
                for problem in check_trajectory(case, output, tokenizer, tool_set, bounds)
            ]
    outputs = [output for output, _ in results if isinstance(output, AgentLoopOutput)]
    faults = sum((Counter(tool_errors_by_kind(output.turns)) for output in outputs), Counter())
    reasons = Counter(output.end_reason for output in outputs)
    print(
        f"\nfuzz: {len(CASES)} hostile outputs through ToolAgentLoop in {elapsed:.1f}s; crashes {len(crashes)}, "
        f"hangs {len(hangs)}, slowest {max(seconds for _, seconds in results):.1f}s; "
        f"faults counted {dict(faults)}; finish reasons {dict(reasons)}"
    )
    assert not crashes, crashes[:10]
    assert not hangs, hangs[:10]
    assert not problems, problems[:20]


def test_an_abort_before_the_model_answers_an_observation_takes_it_back(replay_server, tokenizer, model_path):
    # the engine aborts each second turn before its first token: the tools ran, but the trajectory ends on the
    # model's tool call, not on an observation the model never saw (its reward sits on a model token)
    tool_set = load_tool_set(TOOLS_PATH)
    config = fuzz_config(model_path, "middle")
    indices = [i for i, case in enumerate(CASES) if case.faults and len(case.faults) <= MAX_CALLS][:20]

    async def one(index: int) -> AgentLoopOutput:
        loop = ToolAgentLoop(
            server_manager=Router([replay_server], request_timeout_s=30), tokenizer=tokenizer, config=config
        )
        row = {
            "prompt": fuzz_prompt(index, then_abort=True),
            "agent_name": "tool_agent",
            "request_id": f"abort-{index}",
        }
        return await asyncio.wait_for(loop.run(dict(GREEDY), **row), HANG_BOUND_S)

    async def run_cases() -> list[AgentLoopOutput]:
        return await asyncio.gather(*(one(index) for index in indices))

    outputs = asyncio.run(run_cases())
    ran_tools = 0
    for index, output in zip(indices, outputs):
        turns = output.turns
        assert output.response_mask and set(output.response_mask) == {1}, (index, output.end_reason, turns)
        assert output.metrics["observation_tokens"] == 0 and output.observation_roles == []
        if turns[0].calls:  # a second turn was asked for, and aborted
            ran_tools += 1
            assert output.end_reason == "aborted" and turns[1].model_tokens == 0
            assert turns[0].observation_tokens == 0  # the observation was taken back
            assert output.num_turns == 3  # the prompt and two model turns; no tool turn
        assert check_trajectory(CASES[index], output, tokenizer, tool_set, lambda messages: RESPONSE_LENGTH) == []
    assert ran_tools >= 10


def test_hostile_batch_crosses_ray_pads_and_dumps(manager, tokenizer, tmp_path):
    """A slice of the nastiest outputs through ``AgentLoopManager``: trajectories pickled back from the
    workers, padded into one batch, counted in the step metrics and written to a Parquet rollout dump."""
    nasty = {"deep_nesting", "surrogates", "json_oddities", "many_calls", "large_tool_response", "control_tokens"}
    picked = [index for index, case in enumerate(CASES) if case.category in nasty][::2]
    batch = manager.generate_sequences([{"prompt": fuzz_prompt(index), "agent_name": "tool_agent"} for index in picked])
    faults = sum((Counter(tool_errors_by_kind(turns)) for turns in batch.non_tensor_batch["turns"]), Counter())
    assert len(batch) == len(picked) and faults["too_many_calls"] > 0 and faults["parse_error"] > 0
    assert {kind: batch.meta_info[f"multi_turn/tool_errors/{kind}"] for kind in faults} == dict(faults)
    table = pq.read_table(write_rollout_dump(tmp_path, 0, batch, tokenizer))
    assert table.num_rows == len(picked) and sum(table.column("tool_errors").to_pylist()) == sum(faults.values())
    dumped = sum(
        (Counter(json.loads(extra).get("tool_errors", {})) for extra in table.column("extra").to_pylist()), Counter()
    )
    assert dumped == faults
