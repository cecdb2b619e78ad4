"""Load and aborts: many mixed streams at once all end well, greedy answers do not depend on the load, and
clients that leave mid-stream give back every KV block."""

import asyncio
import random

import httpx
import pytest

from tests.helpers.live_server import MODEL_NAME, completion_text, sse_payloads, wait_idle

NUM_REQUESTS = 400
CONCURRENCY = 32
WORDS = "the river keeps a slow song under old stone bridges while owls count the rain".split()


def mixed_body(i: int) -> dict:
    """Request i of the load: prompt lengths, output lengths and sampling settings cycle; i % 12 == 0 is greedy."""
    rng = random.Random(i)
    prompt = " ".join(rng.choice(WORDS) for _ in range(1 + (i * 7) % 60))
    body = {"model": MODEL_NAME, "max_tokens": [1, 4, 8, 16, 32][i % 5], "stream": True}
    if i % 12 == 0:
        return {**body, "prompt": f"{i}: {prompt}", "temperature": 0, "max_tokens": 16}
    settings = [
        {"temperature": 0.8, "top_p": 0.9, "seed": i},
        {"temperature": 1.0, "top_k": 20},
        {"temperature": 0.7, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"temperature": 1.2, "repetition_penalty": 1.1, "stop": ["\n", " the"]},
        {"temperature": 0.5, "logprobs": 2},
    ]
    body |= settings[i % len(settings)]
    if i % 3 == 1:
        if "logprobs" in body:  # chat spells it differently
            body |= {"logprobs": True, "top_logprobs": body["logprobs"]}
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def stream(client: httpx.AsyncClient, body: dict) -> tuple[str, str | None]:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = await client.post(route, json=body)
    assert r.status_code == 200, r.text
    payloads = sse_payloads(r.content)
    if "messages" not in body:
        return completion_text(payloads)
    assert not any("error" in p for p in payloads), payloads
    text = "".join(c["delta"].get("content") or "" for p in payloads for c in p["choices"])
    return text, payloads[-1]["choices"][0]["finish_reason"]


async def bounded(concurrency: int, jobs) -> list:
    gate = asyncio.Semaphore(concurrency)

    async def one(job):
        async with gate:
            return await job

    return await asyncio.gather(*(one(j) for j in jobs))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_400_mixed_streams_at_32_concurrent(spawn, default_model_dir):
    # The real model: batch invariance is only worth checking where logits are not random noise.
    server = spawn(default_model_dir, "--kv-cache-memory", "512MiB", "--batch-invariant")
    bodies = [mixed_body(i) for i in range(NUM_REQUESTS)]
    greedy = [i for i, b in enumerate(bodies) if b.get("temperature") == 0][:32]
    assert len(greedy) == 32

    async def run() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=CONCURRENCY + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            loaded = await asyncio.wait_for(bounded(CONCURRENCY, (stream(client, b) for b in bodies)), 780)
            alone = [await stream(client, bodies[i]) for i in greedy]
        return loaded, alone

    loaded, alone = asyncio.run(run())
    assert all(reason in ("stop", "length") for _, reason in loaded)
    assert [loaded[i] for i in greedy] == alone
    assert any(text for text, _ in alone)
    m = wait_idle(server.url)
    assert m["kvserve:kv_cache_usage_perc"] == 0
    assert m.get("kvserve:request_success_total{abort}", 0) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_abort_storm_leaves_nothing_behind(spawn, long_tiny_model):
    server = spawn(long_tiny_model)
    rng = random.Random(0)
    # (request index, the number of SSE bytes read before leaving); None = read to the end
    plan = [(i, rng.randrange(1, 2000) if i % 2 else None) for i in range(200)]

    async def one(client: httpx.AsyncClient, i: int, leave_after: int | None):
        body = {"model": MODEL_NAME, "prompt": f"storm {i}", "max_tokens": 32 if leave_after is None else 400,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        received = bytearray()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                received += chunk
                if leave_after is not None and len(received) >= leave_after:
                    return None  # closing the response drops the connection mid-stream
        return completion_text(sse_payloads(bytes(received)))

    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.wait_for(bounded(32, (one(client, i, k) for i, k in plan)), 240)

    results = asyncio.run(run())
    finished = [r for (_, k), r in zip(plan, results, strict=True) if k is None]
    assert len(finished) == 100
    assert all(reason == "length" and text for text, reason in finished)
    m = wait_idle(server.url)
    assert m["kvserve:kv_cache_usage_perc"] == 0
    assert m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
    assert m["kvserve:request_success_total{length}"] == 100
    assert m["kvserve:request_success_total{abort}"] == 100
    # the server still answers as before
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "storm 0", "max_tokens": 32,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == finished[0][0]
