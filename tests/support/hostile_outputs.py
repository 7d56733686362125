"""About a thousand hostile model outputs for the fuzz test, generated from a fixed seed.

Garbage bytes and unicode, tag soup, nested and unclosed ``<tool_call>`` / ``<think>`` tags, huge and
deeply nested JSON, non-object payloads, names that are not strings, unknown tools, arguments that
fail the schema, tools that fail, a hundred and more calls in one turn, and valid calls mixed in.

Each output carries what the ``hermes`` parser and the tools of ``scripted_tools.yaml`` must make of
it, where the generator knows: one entry per call the parser finds, in order, holding the fault kind
the tool loop counts for that call (None: the call runs fine). Outputs whose calls the generator does
not claim to know (random tag soup, chat control tokens that end a turn early) carry None instead.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from agentloop.tools.parsers import format_hermes

SEED = 1729
Fault = str | None  # unknown_tool | parse_error | invalid_arguments | exception | timeout | None (runs fine)
Call = tuple[str, Fault]  # the text of one call and what it must come to


@dataclass(frozen=True)
class HostileOutput:
    category: str
    text: str
    faults: tuple[Fault, ...] | None  # per call the parser finds; None when not claimed


# ---------------------------------------------------------------------------------- text pieces

WORDS = "let me think about this the answer is call tool now maybe again result ok".split()
# astral emoji and math letters, CJK, Arabic/Hebrew with RTL overrides, zero-width and joiners,
# combining marks, a BOM, private use: everything a tokenizer meets outside plain ASCII
UNICODE_POOL = (
    "😀🧪👩‍👩‍👧‍👦🏳️‍🌈𝐀𝔸𝕫𒀀𝄞"
    "漢字かなカナ한국어"
    "مرحبا שלום"
    "\u202e\u202d\u200f\u200e"
    "\u200b\u200c\u200d\u2060\ufeff"
    "e\u0301a\u0308\u20dd"
    "\ue000\U000f0000"
    "\u00a0\u3000\t\r"
)
FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    ":",
    ",",
    '"calculator"',
    '"arguments"',
    '{"expression": "1 + 1"}',
    "\n",
    " ",
    "null",
    "<tool_response>",
    "<function=calculator>",
    "<parameter=expression>",
    "</parameter>",
    "</function>",
    '"',
    "\\",
    "ok",
]


def _words(rng: random.Random, low: int = 1, high: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _unicode(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(UNICODE_POOL) for _ in range(length))


def _prose(rng: random.Random) -> str:
    """Text around calls: nothing, words, or unicode (never a tag, so it cannot change what is parsed)."""
    return rng.choice(["", "\n", _words(rng) + "\n", _unicode(rng, rng.randint(1, 20)) + "\n"])


def _call(rng: random.Random, name: Any, arguments: Any) -> str:
    """One call in one of the shapes models write: Hermes, on one line, indented, arguments as a JSON string."""
    style = rng.randrange(4)
    if style == 0 and isinstance(name, str) and isinstance(arguments, dict):
        return format_hermes(name, arguments)
    if style == 3 and isinstance(arguments, dict):  # some models JSON-encode the arguments
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": json.dumps(arguments)}) + "\n</tool_call>"
    return (
        "<tool_call>"
        + json.dumps({"name": name, "arguments": arguments}, indent=2 if style == 2 else None)
        + "</tool_call>"
    )


def _body(call: str) -> str:
    """What the parser reads of a (possibly cut) call: between the tags, stripped."""
    return call.removeprefix("<tool_call>").removesuffix("</tool_call>").strip()


def _wrap(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# ---------------------------------------------------------------------------------- single calls


def good_call(rng: random.Random) -> Call:
    kind = rng.randrange(3)
    if kind == 0:
        expression = f"{rng.randint(0, 99)} {rng.choice('+-*%')} {rng.randint(1, 99)}"
        return _call(rng, "calculator", {"expression": expression}), None
    if kind == 1:
        return _call(rng, "submit_answer", {"answer": rng.choice([rng.randint(-9, 99), round(rng.random(), 3)])}), None
    return _call(rng, "echo", {"text": _words(rng), "times": rng.randint(1, 3)}), None


def failing_call(rng: random.Random) -> Call:
    """Well-formed calls whose tool raises or times out."""
    name, arguments, fault = rng.choice(
        [
            ("explode", {}, "exception"),
            ("explode", {"anything": [1, 2]}, "exception"),
            ("sleepy", {}, "timeout"),
            ("calculator", {"expression": "1 / 0"}, "exception"),
            ("calculator", {"expression": "__import__('os').getcwd()"}, "exception"),
            ("calculator", {"expression": "(" * 300 + "1" + ")" * 300}, "exception"),
            ("calculator", {"expression": "+".join(["1"] * 3000)}, "exception"),  # RecursionError inside the tool
            ("calculator", {"expression": "\udc00"}, "exception"),  # a lone surrogate, sent as a JSON escape
            ("echo", {"text": "x", "times": 10**30}, "exception"),  # OverflowError, not a 10**30-byte string
        ]
    )
    return _call(rng, name, arguments), fault


def invalid_call(rng: random.Random) -> Call:
    """Known tools, arguments the schema rejects (and no lossless conversion mends: see the lossless cases)."""
    name, arguments = rng.choice(
        [
            ("calculator", {}),
            ("calculator", {"expression": {"value": 5}}),
            ("calculator", {"expression": None}),
            ("calculator", {"expr": "1 + 1"}),
            ("submit_answer", {"answer": "five"}),
            ("submit_answer", {}),
            ("submit_answer", {"answer": True}),
            ("submit_answer", {"answer": [5]}),
            ("echo", {"times": 3}),
            ("echo", {"text": ["a"]}),
            ("echo", {"text": "a", "times": "three"}),
            ("echo", {"text": "a", "times": 1.5}),
            ("echo", {"text": {"nested": "x" * 5000}}),
        ]
    )
    return _call(rng, name, arguments), "invalid_arguments"


def unknown_call(rng: random.Random) -> Call:
    name = rng.choice(
        [
            "weather",
            "",
            " ",
            "CALCULATOR",
            "calculator ",
            "calc\u200bulator",
            "計算機",
            "🧮",
            "\u202ecalculator",
            "a" * 100_000,
            "../../etc/passwd",
            "calculator\n",
            "\ud800",
            _words(rng),
            _unicode(rng, 30),
        ]
    )
    return _call(rng, name, rng.choice([{}, {"expression": "1 + 1"}, {"x": [1, {"y": None}]}])), "unknown_tool"


PARSE_ERROR_BODIES = [
    '{"name": "calculator", "arguments": {"expression": ',
    "{bad json}",
    "",
    "   ",
    "[1, 2, 3]",
    "42",
    "null",
    "true",
    '"calculator"',
    '[{"name": "calculator", "arguments": {}}]',
    '{"name": 5, "arguments": {}}',
    '{"name": null}',
    '{"name": ["calculator"], "arguments": {}}',
    '{"name": {"x": 1}}',
    '{"name": true}',
    '{"arguments": {"expression": "1"}}',
    '{"name": "calculator", "arguments": "not json"}',
    '{"name": "calculator", "arguments": "[1, 2]"}',
    '{"name": "calculator", "arguments": [1]}',
    '{"name": "calculator", "arguments": 7}',
    '{"name": "calculator", "arguments": null}',
    '{"name": "calculator", "arguments": "{\\"expression\\": "}',
    '{"name": "echo", "arguments": {"text": "a"}} trailing',
    '{"name": "echo", "arguments": {"text": "a"}}{"name": "echo", "arguments": {"text": "b"}}',
    "{'name': 'calculator', 'arguments': {'expression': '1'}}",
    "<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</function>",
    '\ufeff{"name": "explode", "arguments": {}}',
    '\u200b{"name": "explode", "arguments": {}}',
    '```json\n{"name": "explode", "arguments": {}}\n```',
    '{"name": "submit_answer", "arguments": {"answer": ' + "7" * 5000 + "}}",
    '{"name": "explode", "arguments": {}',
    '{"name": "explode" "arguments": {}}',
    '{"name": "\\x41", "arguments": {}}',
]


def parse_error_call(rng: random.Random) -> Call:
    return _wrap(rng.choice(PARSE_ERROR_BODIES)), "parse_error"


def any_call(rng: random.Random) -> Call:
    return rng.choice([good_call, good_call, failing_call, invalid_call, unknown_call, parse_error_call])(rng)


def _calls(rng: random.Random, calls: list[Call], category: str) -> HostileOutput:
    """Calls with prose around them."""
    text = _prose(rng) + "".join(call + _prose(rng) for call, _ in calls)
    return HostileOutput(category, text, tuple(fault for _, fault in calls))


def _nested(depth: int, rng: random.Random) -> str:
    """JSON nested ``depth`` levels deep (arrays or objects), valid or left unclosed."""
    open_, close = rng.choice([("[", "]"), ('{"a": ', "}")])
    return open_ * depth + "1" + (close * depth if rng.random() < 0.8 else "")


# ---------------------------------------------------------------------------------- categories


def garbage_bytes(rng: random.Random) -> HostileOutput:
    data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 3000)))
    text = data.decode(rng.choice(["utf-8", "latin-1", "utf-16-le", "cp1252"]), errors="replace")
    return HostileOutput("garbage_bytes", text, ())


def unicode_soup(rng: random.Random) -> HostileOutput:
    return HostileOutput("unicode_soup", _unicode(rng, rng.randint(0, 1500)), ())


def tag_soup(rng: random.Random) -> HostileOutput:
    pieces = [rng.choice(FRAGMENTS + [_words(rng, 1, 2), _unicode(rng, 3)]) for _ in range(rng.randint(1, 80))]
    return HostileOutput("tag_soup", "".join(pieces), None)


def mixed_calls(rng: random.Random) -> HostileOutput:
    return _calls(rng, [any_call(rng) for _ in range(rng.randint(1, 6))], "mixed_calls")


def single(maker: Callable[[random.Random], Call], category: str) -> Callable[[random.Random], HostileOutput]:
    return lambda rng: _calls(rng, [maker(rng) for _ in range(rng.randint(1, 3))], category)


def tag_structure(rng: random.Random) -> HostileOutput:
    """Nested, unclosed and stray ``<tool_call>`` tags; parsing is non-greedy up to the first closer or the end."""
    (a, fa), (b, _) = any_call(rng), any_call(rng)
    # a call cut short: only the complete body parses (a proper prefix of a JSON object never does)
    (whole, whole_fault) = rng.choice([good_call, failing_call, invalid_call, unknown_call])(rng)
    cut = whole[: rng.randint(len("<tool_call>"), len(whole) - len("</tool_call>"))]
    cut_fault = whole_fault if _body(cut) == _body(whole) else "parse_error"
    shapes: list[tuple[str, tuple[Fault, ...]]] = [
        ("<tool_call>" + a + "</tool_call>", ("parse_error",)),  # nested: the body starts with a tag
        (a[: -len("</tool_call>")] + b + "</tool_call>", ("parse_error",)),  # a call inside a call
        (a[: -len("</tool_call>")] + "\n" + b, ("parse_error",)),  # unclosed, then another call
        ("prose\n" + a[: -len("</tool_call>")], (fa,)),  # unclosed at the end: the body is still complete
        (cut, (cut_fault,)),
        ("</tool_call>\n" + a, (fa,)),  # a stray closer first
        ("</tool_call></tool_call>" + _words(rng), ()),
        ("<tool_call>" * rng.randint(2, 500), ("parse_error",)),
    ]
    empties = rng.randint(1, 30)
    shapes.append(("<tool_call></tool_call>" * empties, ("parse_error",) * empties))
    text, faults = rng.choice(shapes)
    return HostileOutput("tag_structure", text, faults)


def think_structure(rng: random.Random) -> HostileOutput:
    """Calls are never parsed inside ``<think>``; the first ``</think>`` closes, an unclosed one hides the rest."""
    (a, fa), (b, fb) = any_call(rng), any_call(rng)
    shapes: list[tuple[str, tuple[Fault, ...]]] = [
        ("<think>" + a + "</think>\n" + _words(rng), ()),
        ("<think>\n" + _words(rng) + a, ()),
        ("<think>" + _words(rng) + "</think>\n" + a, (fa,)),
        ("<think>x<think>y</think>" + a + "</think>", (fa,)),  # the first closer ends the block
        ("</think>" + a, (fa,)),
        (a + "<think>" + b, (fa,)),
        ("<think>" * rng.randint(2, 300) + a, ()),
        ("<tool_call><think>" + _words(rng) + "</think></tool_call>", ("parse_error",)),  # empty once think is gone
        ("<think><tool_call></think>" + a.removeprefix("<tool_call>"), ()),  # the opener was thought, not written
        (a + "<think>" + b + "</think>" + a, (fa, fa)),
    ]
    del fb
    text, faults = rng.choice(shapes)
    return HostileOutput("think_structure", text, faults)


def deep_nesting(rng: random.Random) -> HostileOutput:
    """10,000 ``[`` make ``json.loads`` raise RecursionError; a few hundred parse but are past any sane depth."""
    depth = rng.choice([150, 500, 990, 2000, 10_000, 20_000])
    nested = _nested(depth, rng)
    body = rng.choice(
        [
            nested,
            '{"name": "echo", "arguments": {"text": "a", "extra": ' + nested + "}}",
            '{"name": "echo", "arguments": {"text": ' + nested + "}}",
            '{"name": ' + nested + ', "arguments": {}}',
            '{"name": "echo", "arguments": ' + json.dumps('{"text": "a", "x": ' + nested + "}") + "}",
        ]
    )
    return HostileOutput("deep_nesting", _wrap(body), ("parse_error",))


def huge(rng: random.Random) -> HostileOutput:
    """About a megabyte: string arguments, many keys, long lists, garbage, prose before a call."""
    size = 1_000_000
    shapes: list[Callable[[], tuple[str, tuple[Fault, ...]]]] = [  # built lazily: each is a megabyte
        lambda: (_call(rng, "echo", {"text": "x" * size}), (None,)),
        lambda: (_call(rng, "echo", {"text": "y", **{f"k{i}": i for i in range(size // 12)}}), (None,)),
        lambda: (_wrap("[" + "1," * (size // 2) + "1]"), ("parse_error",)),
        lambda: (_call(rng, "calculator", {"expression": "1+" * (size // 2) + "1"}), ("exception",)),
        lambda: (_unicode(rng, size // 4), ()),
        lambda: ("word " * (size // 5) + format_hermes("explode", {}), ("exception",)),
        lambda: (_wrap('{"name": "' + "\\\\" * (size // 2) + '"}'), ("unknown_tool",)),
    ]
    text, faults = rng.choice(shapes)()
    return HostileOutput("huge", text, faults)


def big_but_fitting(rng: random.Random) -> HostileOutput:
    """Kilobytes of arguments: fits a turn, so the tools and the observation limit meet it."""
    text = rng.choice([_unicode(rng, rng.randint(200, 1500)), "z" * rng.randint(1000, 6000), _words(rng, 100, 600)])
    return _calls(rng, [(_call(rng, "echo", {"text": text, "times": rng.randint(1, 50)}), None)], "big_but_fitting")


def large_tool_response(rng: random.Random) -> HostileOutput:
    """A short call, a long answer (up to about a megabyte): the observation must still be cut to the limit."""
    text = rng.choice(["abc ", _words(rng, 1, 4) + " ", _unicode(rng, rng.randint(1, 10)), "<|im_end|>", "\n"])
    call = _call(rng, "echo", {"text": text, "times": rng.randint(100, 1_000_000 // max(1, len(text)))})
    # the engine would end the turn at a written <|im_end|>: the model escapes it, the tool echoes the token
    call = call.replace("<|im_end|>", "\\u003c|im_end|>")
    return _calls(rng, [(call, None)], "large_tool_response")


def surrogates(rng: random.Random) -> HostileOutput:
    """Lone surrogates can only arrive as JSON escapes; tokenizers reject them, so they must not reach one."""
    text = rng.choice(["\ud800", "a\udfffb", "\ud83d", "\ud83d\ude00", "ok\udc00" * 10])
    calls = [(_call(rng, "echo", {"text": text}), None), (_call(rng, "\ud800" + "x", {}), "unknown_tool")]
    return _calls(rng, calls[: rng.randint(1, 2)], "surrogates")


def many_calls(rng: random.Random) -> HostileOutput:
    """A hundred and more calls in one turn; the loop runs at most ``max_parallel_calls`` of them."""
    makers = [good_call, unknown_call, invalid_call, parse_error_call]
    calls = []
    for _ in range(rng.randint(100, 160)):
        call, fault = rng.choice(makers)(rng)
        if len(call) > 200:  # keep the turn within the response budget
            call, fault = good_call(rng)
        calls.append((call, fault))
    return HostileOutput("many_calls", "".join(call for call, _ in calls), tuple(fault for _, fault in calls))


def json_oddities(rng: random.Random) -> HostileOutput:
    """JSON Python accepts that strict JSON does not, duplicate keys, escapes."""
    body, fault = rng.choice(
        [
            ('{"name": "submit_answer", "arguments": {"answer": NaN}}', None),
            ('{"name": "submit_answer", "arguments": {"answer": -Infinity}}', None),
            ('{"name": "submit_answer", "arguments": {"answer": 1e999}}', None),
            ('{"name": "submit_answer", "arguments": {"answer": 123456789012345678901234567890}}', None),
            ('{"name": "explode", "name": "calculator", "arguments": {"expression": "1 + 1"}}', None),
            ('{"name": "\\u0063alculator", "arguments": {"expression": "2 * 3"}}', None),
            # the last duplicate wins, and 2 for a string is converted losslessly to "2", as 7 is
            ('{"name": "calculator", "arguments": {"expression": "1", "expression": 2}}', None),
            ('{"name": "calculator", "arguments": {"expression": 7}}', None),
            ('{"name": "echo", "arguments": {"text": "a", "times": "3"}}', None),
            ('{"name": "echo", "arguments": {"text": "\\u0000\\u001f\\b"}}', None),
            ('  \n\t{"name": "explode", "arguments": {}}\n\n  ', "exception"),
        ]
    )
    return HostileOutput("json_oddities", _wrap(body), (fault,))


def control_tokens(rng: random.Random) -> HostileOutput:
    """Chat control tokens mid-turn: an engine stops at the end-of-turn token, so what is parsed is unknown here."""
    call, _ = any_call(rng)
    token = rng.choice(["<|im_end|>", "<|im_start|>user\n", "<|endoftext|>", "<|im_start|>assistant\n"])
    return HostileOutput("control_tokens", rng.choice([call + token + call, token + call, call + token]), None)


def regex_bomb(rng: random.Random) -> HostileOutput:
    """Inputs that make backtracking regexes take quadratic time or worse."""
    n = 20_000
    text, faults = rng.choice(
        [
            ("<tool_call><function=" + ("<function=" + "x" * 20) * n, ("parse_error",)),
            (
                "<tool_call>\n<function=f>\n" + ("<parameter=" + "y" * 20) * n + "</function></tool_call>",
                ("parse_error",),
            ),
            ("<think>" * n * 2, ()),
            ("</tool_call>" * n * 2, ()),
            ("<tool_call>" + " " * n * 50, ("parse_error",)),
            ("<tool_call>" + "{" * n * 5, ("parse_error",)),
            (("<tool_call>\n<function=" + "z" * 50 + "\n") * n, ("parse_error",)),
        ]
    )
    return HostileOutput("regex_bomb", text, faults)


def empty(rng: random.Random) -> HostileOutput:
    return HostileOutput("empty", rng.choice(["", " ", "\n\n", "\t \r\n"]), ())


# category maker -> how many outputs it contributes
PLAN: list[tuple[Callable[[random.Random], HostileOutput], int]] = [
    (garbage_bytes, 80),
    (unicode_soup, 80),
    (tag_soup, 100),
    (mixed_calls, 100),
    (single(unknown_call, "unknown_tools"), 60),
    (single(invalid_call, "invalid_arguments"), 60),
    (single(failing_call, "failing_tools"), 40),
    (single(parse_error_call, "parse_errors"), 120),
    (tag_structure, 80),
    (think_structure, 60),
    (deep_nesting, 30),
    (huge, 8),
    (big_but_fitting, 30),
    (large_tool_response, 50),
    (surrogates, 20),
    (many_calls, 30),
    (json_oddities, 30),
    (control_tokens, 10),
    (regex_bomb, 10),
    (empty, 2),
]


def hostile_outputs(seed: int = SEED) -> list[HostileOutput]:
    """The outputs, always the same for a seed. Every text is valid UTF-8 (what decoding tokens yields)."""
    rng = random.Random(seed)
    outputs = [maker(rng) for maker, count in PLAN for _ in range(count)]
    for output in outputs:
        output.text.encode("utf-8")  # a lone surrogate may only appear as a JSON escape
    return outputs
