"""A rollout server's HTTP API against a hostile client on 127.0.0.1: every malformed request gets a 4xx with
a message, never a 500, and the server still generates exactly as before afterwards."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from agentloop import AgentLoopManager
from tests.support.config import small_config

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
MAX_BODY = 65536
GREEDY = {"input_ids": [3, 4, 5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
ROUTES = ("/generate", "/v1/chat/completions", "/abort_request", "/update_weights_from_disk")


@pytest.fixture(scope="module")
def url(local_ray):
    manager = AgentLoopManager(
        small_config(
            f"actor_rollout_ref.rollout.http.api_key={API_KEY}",
            f"actor_rollout_ref.rollout.http.max_body_bytes={MAX_BODY}",
        )
    )
    yield manager.server_addresses[0]
    manager.shutdown()


def junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value of any type, small or large, nested or not."""
    makers = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.randint(-(2**63), 2**63),
        lambda: rng.choice([-1, 0, 1, 1 << 30, 10**12]),
        lambda: rng.uniform(-1e300, 1e300),
        lambda: "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(12))),
        lambda: rng.choice(["", "user", "input_ids", "</tool_call>", "\x00", "ü" * 50]),
        lambda: [rng.randrange(-5, 5000) for _ in range(rng.randrange(1, 20))],
        lambda: [junk(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {rng.choice(["role", "content", "rid", "x"]): junk(rng, depth + 1) for _ in range(rng.randrange(4))},
    ]
    return makers[rng.randrange(len(makers) if depth < 3 else len(makers) - 2)]()


def hostile_requests(count: int, seed: int = 0) -> Iterator[tuple[str, bytes, dict[str, str]]]:
    """(route, body, headers): valid requests with one field broken, junk bodies, bad JSON, no key, huge bodies."""
    rng = random.Random(seed)
    valid = {
        "/generate": GREEDY,
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        "/abort_request": {"rid": "no-such-request"},
        "/update_weights_from_disk": {"model_path": "/no/such/dir"},
    }
    for index in range(count):
        route = ROUTES[index % len(ROUTES)]
        body: Any = json.loads(json.dumps(valid[route]))
        headers = dict(AUTH)
        kind = index // len(ROUTES) % 8
        if kind == 0:  # one field replaced by junk
            body[rng.choice(list(body))] = junk(rng)
        elif kind == 1:  # a field nobody knows
            body[rng.choice(["bogus", "text_input", "max_tokens", "inputs"])] = junk(rng)
        elif kind == 2 and route == "/generate":  # sampling values out of range or of the wrong type
            body["sampling_params"] = {
                rng.choice(
                    ["max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n"]
                ): junk(rng)
            }
        elif kind == 2:
            body = junk(rng)
        elif kind == 3 and route == "/generate":  # token ids outside the vocabulary, or far too many
            body["input_ids"] = rng.choice([[rng.randrange(1024, 2**31)], [-rng.randrange(1, 99)], [7] * 20000, []])
        elif kind == 3 and route == "/v1/chat/completions":
            body["messages"] = rng.choice(
                [
                    [],
                    [{"role": "robot", "content": "x"}],
                    [{"role": "user", "content": [{"type": "image"}]}],
                    [{"content": "no role"}],
                    [{"role": "user", "content": "x" * 30000}],
                ]
            )
        elif kind == 4:  # not JSON at all
            yield (
                route,
                rng.choice(
                    [b"{", b"[1,", b"\xff\xfe", b"null", b'{"a": NaN}', bytes(rng.randrange(256) for _ in range(40))]
                ),
                headers,
            )
            continue
        elif kind == 5:  # missing or wrong API key
            headers["Authorization"] = rng.choice(["", "Bearer wrong", f"Basic {API_KEY}"])
        elif kind == 6:  # over the body limit
            body = {"input_ids": [1] * (MAX_BODY // 2)}
        else:
            body = junk(rng)
        yield route, json.dumps(body).encode(), headers


def test_malformed_requests_get_4xx_and_the_server_keeps_generating(url):
    session = requests.Session()
    before = session.post(url + "/generate", json=GREEDY, headers=AUTH, timeout=60).json()["output_ids"]
    statuses: Counter[int] = Counter()
    server_errors = []
    for route, body, headers in hostile_requests(1000):
        response = session.post(url + route, data=body, headers=headers, timeout=60)
        statuses[response.status_code] += 1
        if response.status_code >= 500:
            server_errors.append((route, body[:200], response.status_code, response.text[:300]))
        elif response.status_code >= 400:
            assert response.text.strip() and json.loads(response.text), (route, body[:200])  # a message, as JSON
    assert server_errors == [], server_errors[:5]
    assert statuses[413] and statuses[401] and statuses[422] and statuses[400] and statuses[404], statuses
    # the same greedy request gives the same tokens: no bad request reached the engine's batch
    assert session.post(url + "/generate", json=GREEDY, headers=AUTH, timeout=60).json()["output_ids"] == before
    print(f"1000 hostile requests: {dict(sorted(statuses.items()))}")


def test_chunked_bodies_are_held_to_the_limit_and_the_docs_are_off_with_a_key(url):
    def chunked(body: bytes, size: int = 4096) -> Iterator[bytes]:  # requests sends a generator chunked
        yield from (body[start : start + size] for start in range(0, len(body), size))

    small = requests.post(url + "/generate", data=chunked(json.dumps(GREEDY).encode(), 16), headers=AUTH, timeout=60)
    assert small.status_code == 200 and len(small.json()["output_ids"]) == 6
    huge = json.dumps({**GREEDY, "input_ids": [1] * MAX_BODY}).encode()
    response = requests.post(url + "/generate", data=chunked(huge), headers=AUTH, timeout=60)
    assert response.status_code == 413 and "max_body_bytes" in response.json()["error"]["message"]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert requests.get(url + path, headers=AUTH, timeout=10).status_code == 404, path
