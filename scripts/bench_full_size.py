"""kvserve and llama.cpp's llama-server on one GGUF file, one server at a time, as issue 45 item 7 measures a
full-size model on a small host: 8k context, the same threads, the same neutral load. For each server: how long it
takes to answer /health, its resident memory after a warm-up request and after the decode run (VmRSS and the peak
VmHWM, split into RssAnon and RssFile: weights copied into the process show as anonymous memory, weights served
from the mapped file as file pages), the KV cache it made (from its log), whether it stays within file + KV + 1 GiB,
and one stream's decode rate (`kvserve bench` at concurrency 1: a fixed seeded prompt of random words, 128 tokens,
greedy, ignore_eos; the decode rate leaves each request's prefill out). Prints a JSON line per server, then a
summary line with the ratio kvserve / llama.cpp.

    python scripts/bench_full_size.py /tmp/peer/models/qwen3moe-30b-a3b.Q4_K_M.gguf

Both servers get a KV cache of exactly --context tokens: llama-server `-c 8192 -np 1` (one slot of 8,192 tokens,
f16), kvserve `--max-model-len 8192` and `--kv-cache-memory` set to 8,192 tokens' worth (bfloat16 on CPU: the same
bytes). llama-server also gets:
- `--load-mode none` (no mmap; its weight repacking stays on, its default and its fast path for Q4_K on AVX2 and
  AVX-512 CPUs). With the map, it reads each Q4_K tensor through the map and repacks it into anonymous memory, and
  the file pages it read stay mapped: the repacked weights are resident twice (measured on the OLMoE cut: 2,079
  MiB RssAnon beside 2,016 MiB RssFile for a 2,075 MiB file), which a 24 GiB host cannot do for a 17 GiB file
  without evicting pages. Without the map each tensor is read once into its own buffer, repacked or not, so it
  holds file + KV + compute buffers, as kvserve does. `--no-repack` would keep the map and drop the fast path.
- `--cache-ram 0`: its prompt cache would otherwise keep up to 8 GiB of old requests' KV in RAM beside the model.
- `-lv 4`: its log then says its KV cache's size and its weight buffers (nothing per token).
LLAMA_ARGS are added after these (the later flag wins: LLAMA_ARGS="--load-mode mmap" puts the map back).
kvserve runs with `--speculative-config off`: a random-weight model's greedy answers repeat themselves, so
n-gram drafts would be accepted far more often than on real text and the figure would not be a decode rate;
KVSERVE_ARGS replaces that (KVSERVE_ARGS= serves with kvserve's defaults).

The host must hold each server alone: before starting one, MemAvailable must exceed file + KV + 1 GiB, or the run
stops saying so; while one runs, a watchdog stops it if MemAvailable falls under --memory-floor (there is no swap
here, and the OOM killer might pick another process). Servers are always stopped at the end, also on errors and
Ctrl-C. Environment: LLAMA_SERVER (default /tmp/peer/llama.cpp/build/bin/llama-server), LLAMA_ARGS,
KVSERVE_ARGS; kvserve runs as `python -m server.cli serve` with this interpreter, from this checkout.
"""

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import gguf

REPO = Path(__file__).resolve().parents[1]
GiB, MiB = 1 << 30, 1 << 20
MEMORY_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def kv_bytes_per_token(path: str) -> int:
    """K and V of one token over all layers, at 2 bytes a value (llama.cpp's f16, kvserve's bfloat16)."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def value(key: str, default=None):
        field_ = reader.fields.get(f"{arch}.{key}")
        return field_.contents() if field_ is not None else default

    layers, heads = value("block_count"), value("attention.head_count")
    kv_heads = value("attention.head_count_kv", heads)
    head_dim = value("embedding_length") // (heads if isinstance(heads, int) else max(heads))
    kv_heads = (
        kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    )  # per-layer counts where they vary
    key, val = value("attention.key_length", head_dim), value("attention.value_length", head_dim)
    return sum(h * (key + val) * 2 for h in kv_heads)


def meminfo(name: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in /proc/meminfo")


def process_memory(pid: int) -> dict:
    """The process's resident memory in MiB (/proc/PID/status)."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in MEMORY_FIELDS:
                found[name] = round(int(rest.split()[0]) / 1024, 1)
    return found


@dataclass
class Server:
    name: str
    command: list[str]
    env: dict
    url: str
    log: Path
    process: subprocess.Popen | None = None
    watchdog_fired: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self, memory_floor: int) -> None:
        with open(self.log, "w") as log:
            # its own process group: stop() ends the server and anything it started, and nothing else
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        threading.Thread(target=self._watch, args=(memory_floor,), daemon=True).start()

    def _watch(self, floor: int) -> None:
        while not self._stop.wait(0.5):
            if meminfo("MemAvailable") < floor:
                self.watchdog_fired = True
                print(f"{self.name}: MemAvailable under {floor / GiB:.1f} GiB, stopping it", file=sys.stderr)
                self.stop()
                return

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the process's start until /health answers 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.process.returncode}) before it was ready: {self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while loading
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])

    def stop(self) -> None:
        self._stop.set()
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def bench(url: str, requests: int, input_len: int, output_len: int, seed: int) -> dict:
    """`kvserve bench` at concurrency 1, as a user runs it: its JSON summary."""
    command = [sys.executable, "-m", "server.cli", "bench", "--url", url, "--concurrency", "1"]
    command += [
        "--num-requests",
        str(requests),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
    ]
    out = subprocess.run(
        command + ["--seed", str(seed)], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(server: Server, file_bytes: int, kv_bytes: int, args) -> dict:
    need = file_bytes + kv_bytes + GiB
    available = meminfo("MemAvailable")
    if available < need:
        raise SystemExit(
            f"refusing to start {server.name}: it needs about {need / GiB:.1f} GiB (file {file_bytes / GiB:.1f} + "
            f"KV {kv_bytes / GiB:.2f} + 1 GiB) and this host has {available / GiB:.1f} GiB available now"
        )
    print(f"== {server.name}: {shlex.join(server.command)}", file=sys.stderr)
    server.start(args.memory_floor * GiB)
    try:
        start_s = server.wait_ready(args.start_timeout)
        warm = bench(server.url, 1, args.input_len, 16, seed=args.seed + 1)  # a prompt the run does not send
        after_warmup = process_memory(server.process.pid)
        run = bench(server.url, args.requests, args.input_len, args.output_len, seed=args.seed)
        after_decode = process_memory(server.process.pid)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else e
        raise SystemExit(
            f"{server.name} failed{' (memory watchdog)' if server.watchdog_fired else ''}: {detail}"
        ) from None
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    budget_mib = need / MiB
    result = {
        "server": server.name,
        "command": shlex.join(server.command),
        "file": args.gguf,
        "file_gib": round(file_bytes / GiB, 3),
        "kv_gib": kv_from_log(server.name, log),
        "start_s": round(start_s, 1),
        "memory_mib": {"after_warmup": after_warmup, "after_decode": after_decode},
        "budget_mib": round(budget_mib, 1),  # file + KV + 1 GiB
        "fits": max(after_warmup["VmRSS"], after_decode["VmRSS"]) <= budget_mib,
        "peak_fits": after_decode["VmHWM"] <= budget_mib,
        "decode_tok_s": run["decode_tokens_per_s_per_stream"],
        "output_tok_s": run["output_tokens_per_s"],
        "ttft_s_p50": run["ttft_s"]["p50"],
        "requests_ok": run["requests_ok"],
        "requests_failed": run["requests_failed"] + warm["requests_failed"],
    }
    if server.name == "llama.cpp":  # where its weights went: CPU (read in), CPU_Mapped (the map), CPU_REPACK
        buffers = re.findall(r"(\S+) model buffer size = +([\d.]+) MiB", log)
        result["model_buffers_mib"] = {name: float(size) for name, size in buffers}
    return result


def kv_from_log(name: str, log: str) -> float | None:
    """The KV cache the server says it made, in GiB."""
    if name == "kvserve":  # "KV cache: 512 blocks of 16 tokens (0.50 GiB, bfloat16)"
        match = re.search(r"KV cache: \d+ blocks of \d+ tokens \(([\d.]+) GiB", log)
        return float(match[1]) if match else None
    match = re.search(r"llama_kv_cache: size = +([\d.]+) MiB", log)  # llama.cpp
    return round(float(match[1]) / 1024, 3) if match else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", help="the GGUF file both servers serve")
    parser.add_argument("--context", type=int, default=8192, help="tokens of context and of KV cache")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="measured requests, one at a time")
    parser.add_argument("--input-len", type=int, default=256, help="prompt length in random words")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--servers", nargs="+", default=["kvserve", "llama.cpp"], choices=("kvserve", "llama.cpp")
    )
    parser.add_argument("--port", type=int, default=18741, help="kvserve's port; llama-server's is the next")
    parser.add_argument(
        "--start-timeout", type=float, default=3600.0, help="seconds a server may take to start"
    )
    parser.add_argument(
        "--memory-floor", type=float, default=0.5, help="GiB of MemAvailable under which to stop"
    )
    args = parser.parse_args()

    if not Path(args.gguf).is_file():
        raise SystemExit(f"no GGUF file {args.gguf}")
    llama_server = os.environ.get("LLAMA_SERVER", "/tmp/peer/llama.cpp/build/bin/llama-server")
    if "llama.cpp" in args.servers and not os.access(llama_server, os.X_OK):
        raise SystemExit(f"no llama-server at {llama_server} (set LLAMA_SERVER)")
    file_bytes = os.path.getsize(args.gguf)
    kv_bytes = kv_bytes_per_token(args.gguf) * args.context
    logs = Path(tempfile.mkdtemp(prefix="bench_full_size."))
    print(f"logs in {logs}", file=sys.stderr)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    kvserve_args = shlex.split(os.environ.get("KVSERVE_ARGS", "--speculative-config off"))
    servers = {
        "kvserve": Server(
            "kvserve",
            [sys.executable, "-m", "server.cli", "serve", "--model", args.gguf, "--host", "127.0.0.1", "--port",
             str(args.port), "--max-model-len", str(args.context), "--kv-cache-memory", str(kv_bytes), "--no-ui",
             *kvserve_args],
            env, f"http://127.0.0.1:{args.port}", logs / "kvserve.log",
        ),
        "llama.cpp": Server(
            "llama.cpp",
            [llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(args.port + 1), "-c",
             str(args.context), "-np", "1", "-t", str(args.threads), "-tb", str(args.threads), "--load-mode", "none",
             "--cache-ram", "0", "-lv", "4", "--no-webui", "-a", "full-size",
             *shlex.split(os.environ.get("LLAMA_ARGS", ""))],
            dict(os.environ), f"http://127.0.0.1:{args.port + 1}", logs / "llama.cpp.log",
        ),
    }  # fmt: skip

    # SIGTERM (a job stopped from outside) unwinds like Ctrl-C, through each server's stop()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {}
    for name in args.servers:
        results[name] = measure(servers[name], file_bytes, kv_bytes, args)
        print(json.dumps(results[name]), flush=True)
    if len(results) == 2:
        ours, theirs = results["kvserve"]["decode_tok_s"], results["llama.cpp"]["decode_tok_s"]
        ratio = ours / theirs if ours and theirs else None
        summary = {
            "summary": "kvserve / llama.cpp, c1 decode",
            "file_gib": round(file_bytes / GiB, 3),
            "kv_gib_expected": round(kv_bytes / GiB, 3),
            "decode_ratio": round(ratio, 3) if ratio else None,
            "within_10pct_or_better": ratio is not None and ratio >= 0.9,
            "kvserve_fits": results["kvserve"]["fits"],
            "llama_cpp_fits": results["llama.cpp"]["fits"],
            "start_s": {name: r["start_s"] for name, r in results.items()},
        }
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
