"""kvserve and llama.cpp's `llama-server --embedding` on one GGUF file, one server at a time: how many texts a
second each embeds under the same load, as a RAG pipeline's indexer sends them (issue 49 item 4).

    python scripts/bench_embeddings.py /tmp/peer/models/qwen3-0.6b.Q8_0.gguf            # host's tier
    python scripts/bench_embeddings.py --tier avx2 /tmp/peer/models/qwen3-0.6b.Q8_0.gguf  # as an AVX2 host would

The load: --texts texts (default 2,000) of random English words, each --min-tokens to --max-tokens long (drawn
uniformly, seeded; lengths are in the GGUF tokenizer's tokens, counted with llama-server's /tokenize), one text
a `POST /v1/embeddings` request, --concurrency requests in flight (default 16), after a warm-up of 16 texts the run
does not send. Both servers pool the last token and normalise (Qwen3-Embedding's pooling: `--pooling last` for
both). Prints a JSON line per server (texts/s, prompt tokens/s, latency p50/p99, resident memory after the run,
the prompt tokens the server counted), then a summary with the ratio kvserve / llama.cpp and the agreement of
the two servers' vectors (the cosine between the vectors they gave for the same texts: both read the same
quantized weights, so they should agree to about the precision of their arithmetic).

llama-server runs with `-np CONCURRENCY` slots of `--max-tokens` + 64 tokens each and a batch (`-b`, `-ub`) of
2,048 tokens so one step can hold many texts, `-t/-tb` --threads; kvserve with `--task embed --pooling last` and
its defaults otherwise. LLAMA_ARGS and KVSERVE_ARGS are added after these (the later flag wins). With
`--tier avx2`, llama-server comes from the AVX2 build beside the native one (build_peer.sh TIER=avx2) and
kvserve runs with KVSERVE_CPU_TIER=avx2 plus torch's ATEN_CPU_CAPABILITY=avx2 and oneDNN's ONEDNN_MAX_CPU_ISA=AVX2.
Environment: LLAMA_SERVER (default /tmp/peer/llama.cpp/build/bin/llama-server, or build-avx2 with --tier avx2).
"""

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_full_size import GiB, Server, process_memory

WORDS = (
    "the river city market winter harbour bridge letter garden window morning silver history question library "
    "engine village mountain station evening doctor teacher kitchen forest island weather number system paper "
    "travel simple quiet bright heavy narrow ancient careful modern gentle sudden distant open close build carry "
    "follow remember explain measure discover return change answer under between across before after around "
    "because although while whether every several another neither either perhaps almost always never often"
).split()


def make_texts(count: int, min_tokens: int, max_tokens: int, seed: int, tokenize) -> list[str]:
    """count texts of random words, each cut to a length drawn uniformly from [min_tokens, max_tokens] tokens."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        want = rng.randint(min_tokens, max_tokens)
        words = [rng.choice(WORDS) for _ in range(want)]  # every word is at least one token
        ids = tokenize(" ".join(words))
        while len(ids) > want:  # drop words from the end until it fits
            words = words[: max(1, len(words) - max(1, (len(ids) - want) // 2))]
            ids = tokenize(" ".join(words))
        texts.append(" ".join(words))
    return texts


async def embed_all(url: str, model: str, texts: list[str], concurrency: int) -> dict:
    """Every text in its own request, concurrency in flight; the vectors, the latencies, the wall time."""
    vectors: list[list[float] | None] = [None] * len(texts)
    latencies, prompt_tokens, failures = [], [], []
    queue = list(enumerate(texts))[::-1]

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            index, text = queue.pop()
            sent = time.perf_counter()
            response = await client.post(f"{url}/v1/embeddings", json={"model": model, "input": text})
            if response.status_code != 200:
                failures.append(f"{response.status_code}: {response.text[:200]}")
                continue
            body = response.json()
            latencies.append(time.perf_counter() - sent)
            vectors[index] = body["data"][0]["embedding"]
            prompt_tokens.append(body.get("usage", {}).get("prompt_tokens", 0))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"vectors": vectors, "latencies": latencies, "prompt_tokens": prompt_tokens, "failures": failures,
            "wall": wall}  # fmt: skip


def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def measure(server: Server, texts: list[str], warmup: list[str], args) -> tuple[dict, list]:
    print(f"== {server.name}: {shlex.join(server.command)}", file=sys.stderr)
    server.start(int(args.memory_floor * GiB))
    try:
        start_s = server.wait_ready(args.start_timeout)
        model = model_id(server.url)
        asyncio.run(embed_all(server.url, model, warmup, args.concurrency))
        run = asyncio.run(embed_all(server.url, model, texts, args.concurrency))
        memory = process_memory(server.process.pid)
    finally:
        server.stop()
    done = len(run["latencies"])
    latencies = sorted(run["latencies"]) or [math.nan]
    result = {
        "server": server.name,
        "command": shlex.join(server.command),
        "start_s": round(start_s, 1),
        "texts": len(texts),
        "texts_ok": done,
        "failures": run["failures"][:3],
        "texts_per_s": round(done / run["wall"], 2),
        "prompt_tokens_per_s": round(sum(run["prompt_tokens"]) / run["wall"], 1),
        "prompt_tokens": sum(run["prompt_tokens"]),
        "latency_s": {"p50": round(statistics.median(latencies), 3),
                      "p99": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)},
        "memory_mib": memory,
    }  # fmt: skip
    return result, run["vectors"]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", help="the GGUF file both servers serve (an embedding model, or any decoder)")
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--min-tokens", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tier", choices=("native", "avx2"), default="native")
    parser.add_argument(
        "--servers", nargs="+", default=["kvserve", "llama.cpp"], choices=("kvserve", "llama.cpp")
    )
    parser.add_argument("--port", type=int, default=18761, help="kvserve's port; llama-server's is the next")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument(
        "--memory-floor", type=float, default=0.5, help="GiB of MemAvailable under which to stop"
    )
    args = parser.parse_args()

    if not Path(args.gguf).is_file():
        raise SystemExit(f"no GGUF file {args.gguf}")
    build = "build" if args.tier == "native" else f"build-{args.tier}"
    llama_server = os.environ.get("LLAMA_SERVER", f"/tmp/peer/llama.cpp/{build}/bin/llama-server")
    if not os.access(llama_server, os.X_OK):
        raise SystemExit(f"no llama-server at {llama_server} (set LLAMA_SERVER; build_peer.sh builds it)")
    logs = Path(tempfile.mkdtemp(prefix="bench_embeddings."))
    print(f"logs in {logs}", file=sys.stderr)
    tier_env = {}
    if args.tier != "native":
        tier_env = {"KVSERVE_CPU_TIER": args.tier, "ATEN_CPU_CAPABILITY": args.tier,
                    "ONEDNN_MAX_CPU_ISA": args.tier.upper()}  # fmt: skip
    port = args.port
    servers = {
        "kvserve": Server(
            "kvserve",
            [sys.executable, "-m", "server.cli", "serve", "--model", args.gguf, "--host", "127.0.0.1", "--port",
             str(port), "--task", "embed", "--pooling", "last", "--no-ui",
             *shlex.split(os.environ.get("KVSERVE_ARGS", ""))],
            dict(os.environ, OMP_NUM_THREADS=str(args.threads), **tier_env), f"http://127.0.0.1:{port}",
            logs / "kvserve.log",
        ),
        "llama.cpp": Server(
            "llama.cpp",
            [llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port + 1), "--embedding",
             "--pooling", "last", "-np", str(args.concurrency), "-c", str(args.concurrency * (args.max_tokens + 64)),
             "-b", "2048", "-ub", "2048", "-t", str(args.threads), "-tb", str(args.threads), "--no-webui",
             "-a", "embedder", *shlex.split(os.environ.get("LLAMA_ARGS", ""))],
            dict(os.environ), f"http://127.0.0.1:{port + 1}", logs / "llama.cpp.log",
        ),
    }  # fmt: skip

    # The texts are cut with llama-server's tokenizer (the GGUF's own), started alone for that.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    llama = servers["llama.cpp"]
    counter = Server("llama.cpp tokenizer", llama.command, llama.env, llama.url, logs / "tokenizer.log")
    counter.start(int(args.memory_floor * GiB))
    try:
        counter.wait_ready(args.start_timeout)
        with httpx.Client(timeout=60) as client:

            def tokenize(text: str) -> list[int]:
                return client.post(f"{counter.url}/tokenize", json={"content": text}).json()["tokens"]

            texts = make_texts(args.texts, args.min_tokens, args.max_tokens, args.seed, tokenize)
            warmup = make_texts(16, args.min_tokens, args.max_tokens, args.seed + 1, tokenize)
    finally:
        counter.stop()

    results, vectors = {}, {}
    for name in args.servers:
        results[name], vectors[name] = measure(servers[name], texts, warmup, args)
        print(json.dumps(results[name]), flush=True)
    if len(results) == 2:
        pairs = [(a, b) for a, b in zip(vectors["kvserve"], vectors["llama.cpp"], strict=True) if a and b]
        cosines = [cosine(a, b) for a, b in pairs]
        ours, theirs = results["kvserve"]["texts_per_s"], results["llama.cpp"]["texts_per_s"]
        summary = {
            "summary": f"kvserve / llama.cpp, {args.texts} texts at c{args.concurrency}, tier {args.tier}",
            "texts_per_s_ratio": round(ours / theirs, 3) if theirs else None,
            "latency_p50_ratio": round(results["kvserve"]["latency_s"]["p50"] / results["llama.cpp"]["latency_s"]["p50"], 3),
            "resident_ratio": round(results["kvserve"]["memory_mib"]["VmRSS"] / results["llama.cpp"]["memory_mib"]["VmRSS"], 3),
            "same_prompt_tokens": results["kvserve"]["prompt_tokens"] == results["llama.cpp"]["prompt_tokens"],
            "vector_cosine": {"min": round(min(cosines), 6), "median": round(statistics.median(cosines), 6)} if cosines else None,
        }  # fmt: skip
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
