"""Many streams at once give what each gives alone; a client that goes away frees its request at once."""

import asyncio
import time

import httpx
import pytest

LONG = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}


async def stream_text(client: httpx.AsyncClient, sse_events, body: dict) -> tuple[str, str]:
    r = await client.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks = sse_events(r.content)
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


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
