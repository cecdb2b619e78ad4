"""Many streams at once give what each gives alone; a client that goes away frees its request at once."""

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import httpx
import pytest

LONG = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}


async def stream_text(client: httpx.AsyncClient, sse_events, body: dict) -> tuple[str, str]:
    r = await client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks = sse_events(r.content)
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_32_concurrent_streams_equal_the_same_requests_alone(default_server, sse_events):
    topics = ["rivers", "bread", "chess", "owls", "glass", "rain", "maps", "bees"]
    bodies = [
        {
            "prompt": f"{i + 1}. A short fact about {topics[i % 8]}{'!' * (i // 8)}:",
            "max_tokens": 8,
            "temperature": 0,
        }
        for i in range(32)
    ]

    async def run() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=default_server, timeout=240, limits=limits) as client:
            together = await asyncio.gather(*(stream_text(client, sse_events, b) for b in bodies))
            alone = [await stream_text(client, sse_events, b) for b in bodies]
        return together, alone

    together, alone = asyncio.run(run())
    assert all(text for text, _ in together)
    assert together == alone


@pytest.mark.timeout(60)
def test_a_client_leaving_mid_stream_aborts_its_request(long_engine, start_server, scrape, wait_for):
    url, _ = start_server(long_engine)
    before = scrape(url).get("kvserve:request_success_total{abort}", 0)
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert scrape(url)["kvserve:kv_cache_usage_perc"] > 0
            left = time.monotonic()
    wait_for(lambda: scrape(url)["kvserve:num_requests_running"] == 0, timeout=5, what="the abort")
    assert time.monotonic() - left < 2
    after = scrape(url)
    assert after["kvserve:kv_cache_usage_perc"] == 0
    assert after["kvserve:request_success_total{abort}"] == before + 1


@pytest.mark.timeout(60)
def test_a_client_leaving_before_a_non_streamed_answer_aborts_it(long_engine, start_server, scrape, wait_for):
    url, _ = start_server(long_engine)
    before = scrape(url).get("kvserve:request_success_total{abort}", 0)
    with httpx.Client(base_url=url, timeout=30) as occupier:
        # One request runs (max_num_seqs=1); the second waits behind it and its client gives up while queued.
        with occupier.stream("POST", "/v1/completions", json={**LONG, "stream": True}):
            wait_for(lambda: long_engine.stats().num_running == 1, what="running")
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=LONG, timeout=0.5)
            wait_for(lambda: long_engine.stats().num_waiting == 0, timeout=3, what="the queued abort")
        wait_for(lambda: long_engine.stats().num_running == 0, timeout=3, what="the running abort")
        # And one that is already generating when its client gives up.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=LONG, timeout=0.5)
        left = time.monotonic()
        wait_for(lambda: scrape(url)["kvserve:num_requests_running"] == 0, timeout=5, what="the abort")
        assert time.monotonic() - left < 2
    after = scrape(url)
    assert after["kvserve:kv_cache_usage_perc"] == 0
    assert after["kvserve:request_success_total{abort}"] == before + 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4000}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000}),
    ],
)
def test_leaving_a_responses_or_messages_stream_aborts_it(
    route, body, long_engine, start_server, scrape, wait_for
):
    url, _ = start_server(long_engine)
    before = scrape(url).get("kvserve:request_success_total{abort}", 0)
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", route, json={**body, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("event: ")
            wait_for(lambda: scrape(url)["kvserve:kv_cache_usage_perc"] > 0, what="generating")
    wait_for(lambda: scrape(url)["kvserve:num_requests_running"] == 0, timeout=5, what="the abort")
    after = scrape(url)
    assert after["kvserve:kv_cache_usage_perc"] == 0
    assert after["kvserve:request_success_total{abort}"] == before + 1


@pytest.mark.timeout(60)
def test_a_grammar_slow_to_convert_is_refused_in_its_budget_and_holds_no_other_tokens(
    long_engine, start_server
):
    """A GBNF grammar of 10,000 chained rules (llguidance's converter takes time quadratic in the chain): a 400
    naming the field once the conversion's budget (2 s) is spent, while a stream running meanwhile keeps its
    pace, as the conversion runs in a child process, not under this process's GIL."""
    url, _ = start_server(long_engine)
    chain = "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(10_000)) + 'r10000 ::= "y"\n'
    body = {"prompt": "hi", "max_tokens": 5, "structured_outputs": {"grammar": chain}}
    arrivals: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            with ThreadPoolExecutor(1) as pool:
                sent = time.monotonic()
                refused = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=20)
                while not refused.done():
                    next(lines)
                    arrivals.append(time.monotonic())
                answered = time.monotonic()
    response = refused.result()
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs"
    assert "2 s" in response.json()["error"]["message"], response.text
    assert answered - sent < 8
    gaps = [b - a for a, b in pairwise([sent, *arrivals])]
    assert len(arrivals) > 20 and max(gaps) < 1.0, (len(arrivals), max(gaps))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", lambda text: {"prompt": text}),
        ("/v1/responses", lambda text: {"input": text}),
        ("/v1/messages", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
    ],
)
def test_a_huge_prompt_is_tokenized_off_the_event_loop(tiny_engine, start_server, route, body):
    """A prompt just under the body limit takes seconds to render and tokenize (then it is refused: longer than
    the context); every other request is answered meanwhile (before, /health waited ~2 s behind each one)."""
    url, _ = start_server(tiny_engine)
    big = body("ab " * 1_300_000)
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(httpx.post, f"{url}{route}", json=big, timeout=60)
        slowest = 0.0
        while not refused.done():
            start = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.02)
        assert refused.result().status_code == 400
    assert slowest < 1.0, f"/health took {slowest:.2f} s while a prompt was tokenized"


@pytest.mark.timeout(120)
def test_a_stream_nobody_reads_is_dropped_and_its_request_aborted(
    long_engine, start_server, wait_for, caplog
):
    """A client that stops reading its stream (its connection's buffers full) for --read-timeout: the server
    drops the stream and the engine stops generating it, rather than piling its output up unread."""
    url, _ = start_server(long_engine, read_timeout=1.0)
    host, port = url.removeprefix("http://").split(":")
    # ~2 KB a token's chunk: ~8 MB in all, more than the connection's buffers hold
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "ignore_eos": True,
                       "stream": True, "logprobs": True, "top_logprobs": 20})  # fmt: skip
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    try:
        wait_for(lambda: long_engine.stats().num_running == 1, what="the stream running")
        wait_for(lambda: long_engine.stats().num_running == 0, what="the unread stream aborted", timeout=60)
        messages = [r.getMessage() for r in caplog.records]
        assert any("read nothing of the stream" in m for m in messages)
        assert not any("failed" in m or "Traceback" in m for m in messages), messages
        s.settimeout(30)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data  # cut, not finished
    finally:
        s.close()
