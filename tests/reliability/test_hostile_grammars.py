"""Hostile grammars against a server that is generating for someone else: each is refused with a 400 naming the
field, or compiles, within GRAMMAR_SECONDS, and the running stream's tokens keep coming meanwhile (grammars
compile off the event loop and off the stepping thread, within a time budget, and GBNF conversion runs in a child
process with a time limit: server/engine/grammar.py)."""

import contextlib
import json
import statistics
import threading
import time

import httpx
import pytest

from tests.helpers.live_server import MODEL_NAME, Server, assert_openai_error

pytestmark = pytest.mark.slow

GRAMMAR_SECONDS = 2.0  # the issue's budget for a refusal or a compile, measured from the client
MAX_ITL_SECONDS = (
    1.5  # the running stream's largest gap while the hostile requests come (generous: 2 shared cores)
)
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def fmt(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "x"\n'


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CASES = {  # name: (extra body fields, the field a refusal names)
    "nested schema 40": (fmt(nested(40)), "response_format"),
    "nested schema 500": (fmt(nested(500)), "response_format"),
    "enum of 200,000": (fmt({"enum": [f"v{i}" for i in range(200_000)]}), "response_format"),
    "anyOf of 5,000 objects": (
        fmt(
            {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(5000)]}
        ),
        "response_format",
    ),
    "regex (a+)+$": ({"structured_outputs": {"regex": "(a+)+$"}}, "structured_outputs"),
    "regex (a|aa)*c": ({"structured_outputs": {"regex": "(a|aa)*c"}}, "structured_outputs"),
    "regex a{100000}": ({"structured_outputs": {"regex": "a{100000}"}}, "structured_outputs"),
    "regex ((a{1,50}){1,50}){1,50}": (
        {"structured_outputs": {"regex": "((a{1,50}){1,50}){1,50}"}},
        "structured_outputs",
    ),
    "regex [a-z]{1000}[0-9]{1000}": (
        {"structured_outputs": {"regex": "[a-z]{1000}[0-9]{1000}"}},
        "structured_outputs",
    ),
    "GBNF chain of 10,000 rules": (
        {"structured_outputs": {"grammar": gbnf_chain(10_000)}},
        "structured_outputs",
    ),
    "3,000 tools": (
        {
            "tools": [{**TOOL, "function": {**TOOL["function"], "name": f"f{i}"}} for i in range(3000)],
            "tool_choice": "required",
        },
        "tools",
    ),
    "128 tools, required": (
        {
            "tools": [{**TOOL, "function": {**TOOL["function"], "name": f"f{i}"}} for i in range(128)],
            "tool_choice": "required",
        },
        "messages",  # the tools' prompt outgrows the tiny model's 4,096-token context
    ),
}


@pytest.mark.timeout(300)
def test_hostile_grammars_answer_in_time_and_never_stall_a_running_stream(spawn, long_tiny_model):
    server: Server = spawn(long_tiny_model)
    body = {"model": MODEL_NAME, "prompt": "once", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    streams: list[list[float]] = []  # each stream's token arrival times
    done = threading.Event()

    def stream() -> None:
        # A fast host writes 4,000 tokens of the tiny model in a few seconds: a stream that ends is followed by
        # the next, so one is always running; gaps are measured within a stream only.
        while not done.is_set():
            arrivals: list[float] = []
            streams.append(arrivals)
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r,
            ):
                for line in r.iter_lines():
                    if done.is_set():
                        return  # closes the stream: the server aborts it
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    while sum(map(len, streams)) < 20:
        assert reader.is_alive(), "the stream never started"
        time.sleep(0.05)
    time.sleep(3)  # ITL before
    hostile_from = time.perf_counter()
    results, named = {}, []
    for name, (extra, field) in CASES.items():
        payload = json.dumps({**CHAT, **extra}).encode()
        start = time.perf_counter()
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            content=payload,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        elapsed = time.perf_counter() - start
        if r.status_code == 200:
            outcome = "200"
        else:
            error = assert_openai_error(r, (400, 413))
            outcome = f"{r.status_code} {error['param']}: {error['message'][:90]}"
            named.append(r.status_code != 400 or (error["param"] or "").startswith(field))
        results[name] = (elapsed, len(payload), outcome)
    hostile_to = time.perf_counter()
    time.sleep(1)
    done.set()
    reader.join(30)

    gaps = [(b, b - a) for arrivals in streams for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)]
    before = [g for t, g in gaps if t < hostile_from]
    during = [g for t, g in gaps if hostile_from <= t <= hostile_to + 0.5]
    for name, (elapsed, size, outcome) in results.items():
        print(f"{name:32s} {elapsed:6.2f} s  {size / 1e6:5.2f} MB  {outcome}")

    def p99(values: list[float]) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[98]

    assert len(before) >= 10 and len(during) >= 10, (len(before), len(during))
    print(
        f"stream ITL: before p99 {p99(before):.3f} s max {max(before):.3f} s ({len(before)}); "
        f"during p99 {p99(during):.3f} s max {max(during):.3f} s ({len(during)})"
    )
    assert all(named), results
    slow = {name: round(r[0], 2) for name, r in results.items() if r[0] > GRAMMAR_SECONDS}
    assert not slow, slow
    assert max(during) < MAX_ITL_SECONDS, (max(during), results)
    assert "Traceback" not in server.log()
