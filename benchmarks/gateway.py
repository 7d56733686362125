"""Session gateway overhead: the same turns as direct ``Router.generate`` calls and as OpenAI chat completions
through gateway sessions.

    python -m benchmarks.gateway [--calls 100] [--tokens 8] [--turns 5] [--sessions 64] [--session-calls 3] [--repeats 3]
        [--client httpx|raw] [--workers 1 2 4] [--no-engine]

One ``hf`` server on one CPU thread, the routers and the gateway in this process (as in an agent-loop worker), the
tiny default model, every turn exactly ``--tokens`` new tokens (``ignore_eos``). (a) ``router.generate`` of the turn's
context ids, rendered beforehand; (b) the same conversation posted to ``/chat/completions`` of a session opened by
``Gateway.start`` + ``Gateway.open`` (an ``httpx`` client on a keep-alive connection): the gateway renders the messages,
records the call, generates through its own router and answers in OpenAI's shape. Pairs alternate which path goes
first (the second of a pair finds the prompt in the engine's prefix cache). Single-turn: ``--calls`` pairs of one call
each. Multi-turn: conversations of ``--turns`` calls, each adding a user message after the reply (the gateway appends
its template delta); its figures are over the extending calls (2nd onwards), at least ``--calls`` of them.

The overhead per call (target <= 5 ms): median (b) minus median (a), and the median of the per-call differences; both
carry the engine's noise, which on a shared machine is larger than the overhead. Without it: ``own``, (b) less the
``generate`` of the gateway's router within that call, split into the handler's work (``Gateway._complete`` less that
``generate``: rendering or delta, the reply decoded, the records) and HTTP (the call as the client times it less
``Gateway._complete``: client, uvicorn, the gateway's app, JSON both ways).

Then ``--sessions`` conversations of ``--session-calls`` calls at once on two servers, through the gateway and
directly through one router, ``--repeats`` times interleaved: calls/s of each (medians) and b/a, and this process's
CPU milliseconds per call; every session's recorded trajectory is checked to be its own conversation exactly (no
tokens of another session). (a) includes no HTTP client; (b) includes its client, in this process: ``--client httpx``
(the OpenAI SDK's) costs this process about as much per call as the gateway's whole server side, so ``--client raw``
(a minimal keep-alive HTTP/1.1 client) measures the gateway's own cost, as with an agent in its own process.

Last, the scaling with ``rollout.agent.num_workers``: for each of ``--workers`` counts, the same sessions spread over
that many worker processes (Ray actors, each with its own routers and gateway, its sessions' clients in it, as an
in-process agent's are), both arms ``--repeats`` times interleaved, calls/s as the driver times the whole batch (the
sessions' check after its clock stops), and the workers' CPU per call.

``--no-engine``: only each arm's CPU per call at ``--sessions`` at once over a router that answers at once
(``engine_free``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import ray
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from agentloop.agent_loop.trajectory import observation_delta
from agentloop.config import compose_config
from agentloop.preparation import prepare
from agentloop.gateway import Gateway, Session
from agentloop.protocol import TokenOutput
from agentloop.router import Router
from agentloop.server.rollout_server import RolloutServer
from agentloop.settings import rollout_settings
from agentloop.worker import settle_collector

THREADS = 1  # per server: two servers share the two cores with this process, which serves the gateway


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def conversation_texts(tag: str, calls: int) -> list[str]:
    """The user message of each call of conversation ``tag``: its own words, so a session's tokens name it."""
    return [f"conversation {tag}, question {k}: what comes next?" for k in range(calls)]


class RawResponse:
    """What ``RawClient.post`` returns: the status and the JSON body."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    def raise_for_status(self) -> None:
        if self.status != 200:
            raise RuntimeError(f"HTTP {self.status}: {self.body[:200]!r}")

    def json(self) -> Any:
        return orjson.loads(self.body)


class RawClient:
    """The least an HTTP/1.1 client can do (one keep-alive connection, opened again once the server has closed it, a
    request written in one piece, a response read by its ``Content-Length`` within one timeout, JSON by orjson both
    ways): with it the gateway arm measures the gateway, not ``httpx``'s per-call work, which is the agent's (in its
    own process for a command) and at 64 sessions costs this process as much as the gateway's whole server side."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, url: str, headers: dict[str, str], json: Any) -> RawResponse:
        parts = urllib.parse.urlsplit(url)  # (cached by urllib)
        if self.streams is None or self.streams[0].at_eof():  # (uvicorn closes a connection idle for 5 s)
            self.streams = await asyncio.open_connection(parts.hostname, parts.port)
        reader, writer = self.streams
        body = orjson.dumps(json)
        head = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
        writer.write(
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{head}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        async with asyncio.timeout(self.timeout):  # (not wait_for: a task per call)
            lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            fields = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
            return RawResponse(int(lines[0].split()[1]), await reader.readexactly(int(fields["content-length"])))

    async def aclose(self) -> None:
        if self.streams is not None:
            self.streams[1].close()


class Paths:
    """The two ways to run a conversation (one user message per call), each returning every call's seconds."""

    def __init__(
        self,
        router: Router,
        gateway: Gateway,
        tokenizer: PreTrainedTokenizerBase,
        params: dict[str, Any],
        clients: int,
        client: str,
    ) -> None:
        self.router, self.gateway, self.tokenizer, self.params = router, gateway, tokenizer, params
        # a client per session at once, as each agent has its own: one client's pool of many connections costs
        # httpcore time quadratic in them (at 64 sessions it, not the gateway, would be measured)
        self.idle_clients = [
            httpx.AsyncClient(timeout=120) if client == "httpx" else RawClient(timeout=120) for _ in range(clients)
        ]
        self.sessions: list[tuple[Session, list[str], list[dict[str, Any]]]] = []  # kept for the leakage check

    async def direct(self, tag: str, texts: list[str]) -> list[float]:
        """(a) The context ids of each call built as the gateway records them (the first message rendered, then after
        each reply its eos and the next message's template delta), computed before the call is timed."""
        eos = self.tokenizer.eos_token_id
        ids = list(self.tokenizer.apply_chat_template([user(texts[0])], add_generation_prompt=True, return_dict=False))
        seconds = []
        with Router.running_sample(tag):
            for k in range(len(texts)):
                if k:
                    ids += ([] if ids[-1] == eos else [eos]) + observation_delta(self.tokenizer, [user(texts[k])])
                start = time.perf_counter()
                output = await self.router.generate(tag, ids, dict(self.params))
                seconds.append(time.perf_counter() - start)
                assert len(output.token_ids) == self.params["max_new_tokens"], output
                ids += output.token_ids
        return seconds

    async def through_gateway(self, tag: str, texts: list[str]) -> list[float]:
        """(b) A session of the conversation: each call sends the messages so far, the replies as returned."""
        with Router.running_sample(tag):
            session = self.gateway.open(self.params, timeout_s=600, max_tokens_per_call=None)
        url, headers = (
            self.gateway.base_url(session) + "/chat/completions",
            {"Authorization": f"Bearer {session.api_key}"},
        )
        messages: list[dict[str, Any]] = []
        completions, seconds = [], []
        client = self.idle_clients.pop()
        try:
            for text in texts:
                messages.append(user(text))
                start = time.perf_counter()
                response = await client.post(url, headers=headers, json={"model": "m", "messages": messages})
                seconds.append(time.perf_counter() - start)
                response.raise_for_status()
                completion = response.json()
                assert len(completion["choices"][0]["token_ids"]) == self.params["max_new_tokens"], completion
                completions.append(completion)
                messages.append({"role": "assistant", "content": completion["choices"][0]["message"]["content"]})
        finally:
            self.idle_clients.append(client)
            await self.gateway.close(session)
        self.sessions.append((session, texts, completions))
        return seconds


def check_own_trajectories(
    tokenizer: PreTrainedTokenizerBase, sessions: list[tuple[Session, list[str], list[dict]]]
) -> None:
    """Each session recorded exactly its own conversation: its first message rendered, then per call the tokens the
    gateway returned for it and the eos and template delta of its own next message, and each call's context as the
    gateway returned it."""
    eos = tokenizer.eos_token_id
    for session, texts, completions in sessions:
        trajectory = session.trajectory
        expected = list(tokenizer.apply_chat_template([user(texts[0])], add_generation_prompt=True, return_dict=False))
        assert trajectory.prompt_ids == expected, f"session {texts[0]!r}: its prompt is not its own first message"
        for k, completion in enumerate(completions):
            if k:
                expected += ([] if expected[-1] == eos else [eos]) + observation_delta(tokenizer, [user(texts[k])])
            assert completion["prompt_token_ids"] == expected, f"session {texts[0]!r}, call {k}: another context"
            expected += completion["choices"][0]["token_ids"]
        assert trajectory.ids == expected, f"session {texts[0]!r}: its trajectory holds tokens it was never given"


class Clock:
    """Seconds per call of an object's async method, timed by wrapping it on that object (calls one at a time)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds: list[float] = []
        original = getattr(owner, name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        setattr(owner, name, timed)


async def paired(
    calls: int,
    turns: int,
    direct: Callable[[str, list[str]], Awaitable[list[float]]],
    gateway: Callable[[str, list[str]], Awaitable[list[float]]],
    tag: str,
) -> tuple[list[float], list[float]]:
    """Conversations of ``turns`` calls on both paths, alternating which goes first, until ``calls`` calls of each
    (from the 2nd call of each conversation when ``turns`` > 1) are timed: the seconds of those calls, in pairs."""
    direct_s: list[float] = []
    gateway_s: list[float] = []
    pair = 0
    while len(direct_s) < calls:
        texts = conversation_texts(f"{tag}-{pair}", turns)
        if pair % 2:
            b, a = await gateway(f"{tag}-{pair}-b", texts), await direct(f"{tag}-{pair}-a", texts)
        else:
            a, b = await direct(f"{tag}-{pair}-a", texts), await gateway(f"{tag}-{pair}-b", texts)
        direct_s += a[1 if turns > 1 else 0 :]
        gateway_s += b[1 if turns > 1 else 0 :]
        pair += 1
    return direct_s, gateway_s


async def concurrent(
    run: Callable[[str, list[str]], Awaitable[list[float]]], tag: str, sessions: int, calls: int
) -> tuple[float, float]:
    """Calls per second of ``sessions`` conversations of ``calls`` calls run at once, and this process's CPU
    milliseconds per call (steadier than the rate on a loaded machine: the engines' share of the cores varies)."""
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(run(f"{tag}-{i}", conversation_texts(f"{tag}-{i}", calls)) for i in range(sessions)))
    return sessions * calls / (time.perf_counter() - start), 1000 * (time.process_time() - cpu) / (sessions * calls)


@ray.remote(num_cpus=0)
class WorkerPaths:
    """An agent-loop worker's process for the scaling runs: its own routers over the servers, its own gateway, its
    share of the sessions (their clients in it, as an in-process agent's are)."""

    def __init__(self, servers: list[ray.actor.ActorHandle], config, args: argparse.Namespace, share: int) -> None:
        self.servers, self.config, self.args, self.share = servers, config, args, share
        self.tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        self.paths: Paths | None = None
        settle_collector()  # as AgentLoopWorker does

    async def run(self, arm: str, tag: str, calls: int) -> tuple[int, float]:
        """This worker's sessions of ``calls`` calls each on ``arm`` ("direct" or "through_gateway"): their calls, and
        this process's CPU milliseconds in them."""
        if self.paths is None:
            self.paths = await paths(
                self.servers, self.tokenizer, self.config, _params(self.args), self.share, self.args.client
            )
        self.paths.sessions.clear()
        _, cpu_ms = await concurrent(getattr(self.paths, arm), tag, self.share, calls)
        return self.share * calls, cpu_ms * self.share * calls

    def check(self) -> None:
        """The last gateway run's sessions each recorded exactly its own conversation: called once the driver's clock
        has stopped, so that the gateway arm's rate, like the direct one's, times the calls alone."""
        check_own_trajectories(self.tokenizer, self.paths.sessions)


async def scaling(args: argparse.Namespace, servers: list[ray.actor.ActorHandle], config) -> list[tuple]:
    """For each of ``--workers`` worker counts, ``--sessions`` conversations spread over that many worker processes
    (as ``rollout.agent.num_workers`` spreads samples), both arms ``--repeats`` times interleaved: calls/s medians."""
    rows = []
    for count in args.workers:
        shares = [args.sessions // count + (k < args.sessions % count) for k in range(count)]
        workers = [WorkerPaths.remote(servers, config, args, share) for share in shares]
        try:

            async def rate(arm: str, tag: str, calls: int) -> tuple[float, float]:
                start = time.perf_counter()
                done = await asyncio.gather(*(w.run.remote(arm, f"{tag}-w{k}", calls) for k, w in enumerate(workers)))
                seconds = time.perf_counter() - start
                await asyncio.gather(*(worker.check.remote() for worker in workers))
                count = sum(calls for calls, _ in done)
                return count / seconds, sum(cpu_ms for _, cpu_ms in done) / count

            await rate("direct", "warm-up-direct", 1), await rate("through_gateway", "warm-up-gateway", 1)
            runs = [
                (
                    await rate("direct", f"direct-{r}", args.session_calls),
                    await rate("through_gateway", f"gw-{r}", args.session_calls),
                )
                for r in range(args.repeats)
            ]
        finally:
            for worker in workers:
                ray.kill(worker)
        (direct_rate, direct_cpu), (gateway_rate, gateway_cpu) = (
            [statistics.median(column) for column in zip(*arm)] for arm in zip(*runs)
        )
        rows.append((count, direct_rate, gateway_rate, direct_cpu, gateway_cpu))
    return rows


def _params(args: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True, "max_new_tokens": args.tokens}


def ms(seconds: list[float]) -> float:
    return 1000 * statistics.median(seconds)


async def paths(
    servers: list[ray.actor.ActorHandle], tokenizer, config, params: dict[str, Any], clients: int, client: str
) -> Paths:
    """The two paths over ``servers``, each with its own router: what the gateway's router does is the gateway's."""
    gateway = Gateway(Router(servers), tokenizer, rollout_settings(config))
    await gateway.start()
    return Paths(Router(servers), gateway, tokenizer, params, clients, client)


async def measure(args: argparse.Namespace, servers: list[ray.actor.ActorHandle], tokenizer, config) -> None:
    params = _params(args)
    one = await paths(servers[:1], tokenizer, config, params, clients=1, client=args.client)
    complete, generate = Clock(one.gateway, "_complete"), Clock(one.gateway.router, "generate")

    await paired(4, 2, one.direct, one.through_gateway, "warm-up")
    rows = []
    for name, turns in (("single-turn", 1), (f"multi-turn ({args.turns} calls, from the 2nd)", args.turns)):
        complete.seconds.clear(), generate.seconds.clear()
        one.sessions.clear()
        direct_s, gateway_s = await paired(args.calls, turns, one.direct, one.through_gateway, name.split()[0])
        check_own_trajectories(tokenizer, one.sessions)
        handled = [seconds for i, seconds in enumerate(complete.seconds) if turns == 1 or i % turns]
        generated = [seconds for i, seconds in enumerate(generate.seconds) if turns == 1 or i % turns]
        rows.append(
            (
                name,
                len(direct_s),
                ms(direct_s),
                ms(gateway_s),
                ms(gateway_s) - ms(direct_s),
                ms([b - a for a, b in zip(direct_s, gateway_s)]),
                ms([b - g for b, g in zip(gateway_s, generated)]),
                ms([h - g for h, g in zip(handled, generated)]),
                ms([b - h for b, h in zip(gateway_s, handled)]),
            )
        )
    await asyncio.gather(*(client.aclose() for client in one.idle_clients))

    both = await paths(servers, tokenizer, config, params, clients=args.sessions, client=args.client)
    await concurrent(both.direct, "warm-up-direct", args.sessions, 1)
    await concurrent(both.through_gateway, "warm-up-gateway", args.sessions, 1)  # (each client's connection opens)
    direct_runs, gateway_runs = [], []
    for repeat in range(args.repeats):
        direct_runs.append(await concurrent(both.direct, f"direct-{repeat}", args.sessions, args.session_calls))
        both.sessions.clear()
        gateway_runs.append(
            await concurrent(both.through_gateway, f"gateway-{repeat}", args.sessions, args.session_calls)
        )
        check_own_trajectories(tokenizer, both.sessions)
    await asyncio.gather(*(client.aclose() for client in both.idle_clients))

    print(f"one hf server, {THREADS} thread; {args.tokens} new tokens per call; {args.client} client; medians (ms)")
    print(
        f"{'calls':<40} {'n':>3} {'(a) direct':>10} {'(b) gateway':>11} {'b-a':>6} {'pairs':>6} {'own':>6} {'handler':>8} "
        f"{'HTTP':>6}"
    )
    for name, count, a, b, overhead, pairs, own, handler, http in rows:
        print(
            f"{name:<40} {count:3d} {a:10.2f} {b:11.2f} {overhead:6.2f} {pairs:6.2f} {own:6.2f} {handler:8.2f} {http:6.2f}"
        )
    print(
        "b-a: the overhead per call, target <= 5 ms; pairs: median of the per-call differences; own: (b) less its router's "
        "generate, the overhead without the engine's noise, of which handler: Gateway._complete less the generate, and "
        "HTTP: the client's time less Gateway._complete"
    )
    (direct_rate, direct_cpu), (gateway_rate, gateway_cpu) = (
        [statistics.median(column) for column in zip(*runs)] for runs in (direct_runs, gateway_runs)
    )
    print(
        f"{args.sessions} sessions x {args.session_calls} calls at once, two servers ({args.repeats} repeats, medians): "
        f"(a) direct {direct_rate:.1f} calls/s, (b) gateway {gateway_rate:.1f} calls/s, b/a {gateway_rate / direct_rate:.3f}; "
        f"{len(both.sessions)} sessions' trajectories checked after each repeat: each exactly its own; "
        f"this process's CPU per call: (a) {direct_cpu:.2f} ms, (b) {gateway_cpu:.2f} ms (its client's included)"
    )
    for count, direct_rate, gateway_rate, direct_cpu, gateway_cpu in await scaling(args, servers, config):
        print(
            f"{args.sessions} sessions over {count} worker process(es): (a) direct {direct_rate:.1f} calls/s, "
            f"(b) gateway {gateway_rate:.1f} calls/s, b/a {gateway_rate / direct_rate:.3f} (medians of {args.repeats}); "
            f"the workers' CPU per call: (a) {direct_cpu:.2f} ms, (b) {gateway_cpu:.2f} ms"
        )


class InstantRouter:
    """The router's stand-in in ``--no-engine`` runs: every call answered at once (in the event loop's next turn, as
    a router's answer comes) with the same tokens, so that what each arm costs this process is measured without the
    engines competing for the cores."""

    async def generate(
        self, request_id: str, ids: list[int], params: dict[str, Any], image_data: Any = None
    ) -> TokenOutput:
        await asyncio.sleep(0)
        count = params["max_new_tokens"]
        return TokenOutput([1000 + k for k in range(count)], [-0.5] * count, "length")


async def engine_free(args: argparse.Namespace, tokenizer, config) -> None:
    """``--no-engine``: ``--sessions`` conversations of ``--session-calls`` calls at once on each arm over an
    ``InstantRouter``, ``--repeats`` times interleaved: this process's CPU per call of each, and the difference (the
    gateway's own cost, its client's included), steadier than calls/s on a machine shared with other jobs."""
    router = InstantRouter()
    gateway = Gateway(router, tokenizer, rollout_settings(config))
    await gateway.start()
    both = Paths(router, gateway, tokenizer, _params(args), args.sessions, args.client)
    cpu: dict[str, list[float]] = {"direct": [], "through_gateway": []}
    for repeat in range(-1, args.repeats):  # (the first, one call a session, opens the clients' connections)
        for arm, runs in cpu.items():
            both.sessions.clear()
            calls = 1 if repeat < 0 else args.session_calls
            cpu_ms = (await concurrent(getattr(both, arm), f"{arm}{repeat}", args.sessions, calls))[1]
            runs += [] if repeat < 0 else [cpu_ms]
        check_own_trajectories(tokenizer, both.sessions)
    direct_cpu, gateway_cpu = (statistics.median(runs) for runs in cpu.values())
    print(
        f"no engine, {args.sessions} sessions x {args.session_calls} calls at once, {args.client} client, "
        f"{args.repeats} repeats: this process's CPU per call (medians): (a) direct {direct_cpu:.3f} ms, "
        f"(b) gateway {gateway_cpu:.3f} ms, b-a {gateway_cpu - direct_cpu:.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="timed calls per path, single-turn and multi-turn")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per call")
    parser.add_argument("--turns", type=int, default=5, help="calls per multi-turn conversation")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--session-calls", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workers",
        type=int,
        nargs="*",
        default=[1, 2, 4],
        help="worker process counts of the scaling runs (none: skip)",
    )
    parser.add_argument(
        "--client",
        choices=("httpx", "raw"),
        default="httpx",
        help="the gateway arm's HTTP client: httpx (as the OpenAI SDK's), or raw (a minimal keep-alive HTTP/1.1 client)",
    )
    parser.add_argument(
        "--no-engine",
        action="store_true",
        help="only the CPU per call of both arms at --sessions at once, over a router that answers at once",
    )
    args = parser.parse_args()
    config = compose_config(
        [
            f"actor_rollout_ref.rollout.resources_per_server.CPU={THREADS}",
            # room for every turn of the longest conversation: its replies and its questions' deltas (about 25 tokens)
            f"data.max_response_length={max(args.turns, args.session_calls) * (args.tokens + 64)}",
        ]
    )
    prepare(config)
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    if args.no_engine:
        settle_collector()
        asyncio.run(engine_free(args, tokenizer, config))
        return
    # a cluster of its own, even when another job has left one as the current cluster
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    settle_collector()  # as an agent-loop worker does once it is set up
    servers = [RolloutServer.remote(rollout_settings(config).servers, rank) for rank in range(2)]
    try:
        ray.get([server.__ray_ready__.remote() for server in servers], timeout=600)
        asyncio.run(measure(args, servers, tokenizer, config))
    finally:
        for server in servers:
            ray.kill(server)
        ray.shutdown()


if __name__ == "__main__":
    main()
