"""`kvserve bench`: a serving benchmark against any OpenAI-compatible server: streamed requests at a concurrency, of
random words (completions, a fixed output length), of one of workloads.py's chat workloads (edit, quote,
chat, json: what speculative decoding is for, or not), or conversations (turns: each turn sends the whole history
back, what a prefix cache is for)."""

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from client.http import first_model, headers, sse_events
from server.bench.workloads import PERSON, user_messages

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "number group problem fact river mountain city music story garden science letter window history market "
    "energy language ocean forest island bridge engine planet signal theory window morning evening summer"
).split()


@dataclass
class Result:
    ok: bool
    ttft: float | None = None  # None: no event carried text (a model whose tokens decode to nothing)
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens, if it says
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the streamed output
    turn: int = 1  # its place in its conversation (the turns workload)


def _text(event: dict) -> str:
    """The text an event of a streamed completion or chat completion carries."""
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _one_request(client: httpx.AsyncClient, url: str, route: str, body: dict) -> Result:
    start = time.perf_counter()
    last = None
    chunks = 0  # events that carried text: the output's tokens where the server reports no usage
    result = Result(ok=False)
    try:
        async with client.stream("POST", f"{url}{route}", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for event in sse_events(response):
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                now = time.perf_counter()
                if event.get("choices") and _text(event):
                    result.text += _text(event)
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if usage := event.get("usage"):
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": round(q[49], 4), "p90": round(q[89], 4), "p99": round(q[98], 4)}


def shared_prefixes(rng: random.Random, count: int, length: int) -> list[str]:
    """`count` distinct prompt beginnings of `length` words (system prompts several requests share)."""
    if length == 0:
        return [""]
    return [" ".join(rng.choice(WORDS) for _ in range(length)) + "\n" for _ in range(count)]


async def bench_http(args) -> dict:
    """Send streamed completions at `concurrency`: `num_requests` of them, or, with `duration`, as many as
    start within that many seconds (at most `num_requests` if given). Each prompt is `input_len` random
    words, after one of `num_shared_prefixes` shared beginnings of `shared_prefix_len` words when that is
    set (a shared system prompt: what a prefix cache, and a router that knows it, make cheap). Prints a
    summary and a JSON line."""
    url = args.url.rstrip("/")
    model = args.model or first_model(url, args.api_key)
    rng = random.Random(args.seed)
    prefixes = shared_prefixes(rng, args.num_shared_prefixes, args.shared_prefix_len)
    limit = args.num_requests if args.num_requests is not None or args.duration else 64
    sent = 0
    results: list[Result] = []
    deadline = time.perf_counter() + args.duration if args.duration else None

    def request(i: int) -> tuple[str, dict]:
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        if args.workload == "random":
            prompt = rng.choice(prefixes) + " ".join(rng.choice(WORDS) for _ in range(args.input_len))
            body = {"prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True}
            return "/v1/completions", {"model": model, **body, "temperature": 0.0, **stream}
        # a chat workload's messages in turn, greedy, each to its natural end (at most --output-len tokens)
        messages = user_messages(args.workload)
        body = {
            "messages": [{"role": "user", "content": messages[i % len(messages)]}],
            "max_tokens": args.output_len,
        }
        if args.workload == "json":
            schema = {"name": "person", "schema": PERSON}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return "/v1/chat/completions", {"model": model, **body, "temperature": 0.0, **stream}

    def more() -> bool:
        return (limit is None or sent < limit) and (deadline is None or time.perf_counter() < deadline)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while more():
            sent += 1
            results.append(await _one_request(client, url, *request(sent - 1)))

    async def conversations(client: httpx.AsyncClient) -> None:
        """Conversations one after another: a first message of input_len words, then num_turns - 1 more turns,
        each sending the history (every message and reply so far) and a new message of turn_len words."""
        nonlocal sent
        while more():
            words = args.input_len
            messages = []
            for turn in range(1, args.num_turns + 1):
                if not more():
                    return
                sent += 1
                messages.append(
                    {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}
                )
                body = {"model": model, "messages": messages, "max_tokens": args.output_len, "ignore_eos": True,
                        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                result = await _one_request(client, url, "/v1/chat/completions", body)
                result.turn = turn
                results.append(result)
                if not result.ok:
                    break
                messages.append({"role": "assistant", "content": result.text})
                words = args.turn_len

    limits = httpx.Limits(max_connections=args.concurrency)
    start = time.perf_counter()
    async with httpx.AsyncClient(headers=headers(args.api_key), timeout=600, limits=limits) as client:
        run = conversations if args.workload == "turns" else worker
        await asyncio.gather(*(run(client) for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    streaming = [r for r in ok if r.ttft is not None and r.output_tokens > 1 and r.e2e > r.ttft]
    prompt_tokens = sum(r.prompt_tokens for r in reported)
    summary = {
        "url": url,
        "model": model,
        "workload": args.workload,
        "concurrency": args.concurrency,
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        # one stream's decode rate, prefill left out: the tokens after each first one over the time after it
        "decode_tokens_per_s_per_stream": round(
            sum(r.output_tokens - 1 for r in streaming) / sum(r.e2e - r.ttft for r in streaming), 2
        )
        if streaming
        else None,
        # share of prompt tokens the server found in its prefix cache (None: it does not say)
        "cached_prompt_share": round(sum(r.cached_tokens for r in reported) / prompt_tokens, 3)
        if prompt_tokens
        else None,
        "ttft_s": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _percentiles([t for r in ok for t in r.itl]),
        "e2e_s": _percentiles([r.e2e for r in ok]),
    }
    if args.workload == "turns":  # a later turn's TTFT is what a prefix cache saves
        turns = sorted({r.turn for r in ok})
        summary["ttft_by_turn_s"] = {
            t: _percentiles([r.ttft for r in ok if r.turn == t and r.ttft is not None]) for t in turns
        }
        summary["cached_prompt_share_by_turn"] = {
            t: round(sum(r.cached_tokens for r in by) / max(sum(r.prompt_tokens for r in by), 1), 3)
            for t in turns
            if (by := [r for r in reported if r.turn == t])
        }
    print(f"requests ok {len(ok)}, failed {summary['requests_failed']}, in {wall:.1f} s")
    print(f"output tokens/s {summary['output_tokens_per_s']}, requests/s {summary['requests_per_s']}")
    print(f"decode tokens/s per stream {summary['decode_tokens_per_s_per_stream']}")
    if summary["cached_prompt_share"] is not None:
        print(f"prompt tokens found in the prefix cache: {100 * summary['cached_prompt_share']:.1f}%")
    for name in ("ttft_s", "itl_s", "e2e_s"):
        print(f"{name[:-2]:>5}: " + ", ".join(f"{k} {v}" for k, v in summary[name].items()))
    for turn, ttft in summary.get("ttft_by_turn_s", {}).items():
        cached = summary["cached_prompt_share_by_turn"].get(turn)
        shown = f", {100 * cached:.1f}% of its prompt cached" if cached is not None else ""
        print(f"turn {turn} ttft: " + ", ".join(f"{k} {v}" for k, v in ttft.items()) + shown)
    for r in results:
        if not r.ok:
            print("error:", r.error, file=sys.stderr)
            break
    print(json.dumps(summary), flush=True)
    return summary
