"""scripts/bench_peers.py, the benchmark that makes the README's ratios against llama.cpp and vLLM: its arguments,
its medians and ratios, the files it makes for llama.cpp, the memory it reads, and its load against a live kvserve.
The peers themselves are built and run by hand (scripts/build_peers.sh takes ~10 minutes: not in the suite)."""

import argparse
import asyncio
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.bench import http as bench_http
from tests.helpers.gguf_writers import write_tiny_gguf

SCRIPTS = Path(__file__).parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))  # as when it runs: bench_full_size.py is beside it
    try:
        yield importlib.import_module("bench_peers")
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.timeout(10)
def test_arguments_default_to_the_readme_load_and_refuse_what_cannot_run(bench, monkeypatch):
    monkeypatch.delenv("TIER", raising=False)
    monkeypatch.setenv("ROUNDS", "3")
    args = bench.parse_args([])
    assert args.rounds == 3 and args.tier == "native" and args.formats == ["Q8_0", "F16", "Q4_1"]
    assert [(lv.concurrency, lv.requests) for lv in args.levels] == [(1, 8), (32, 64)]
    assert [lv.name for lv in args.levels] == ["c1", "c32"]
    # one file of one's own: llama.cpp serves it as it is, unless formats are named
    assert bench.parse_args(["--gguf", "m.gguf"]).formats == ["file"]
    assert bench.parse_args(["--gguf", "m.gguf", "--formats", "Q8_0"]).formats == ["Q8_0"]
    assert bench.parse_args(["--levels", "4:16", "--tier", "avx2"]).levels == [bench.Level(4, 16)]
    for bad in (["--levels", "32"], ["--levels", "0:4"], ["--levels", "8:4"], ["--levels", "a:b"],
                ["--rounds", "0"], ["--tier", "avx512"], ["--no-llama-cpp"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert bench.parse_args(["--no-llama-cpp", "--vllm"]).vllm


def run(system: str, level: str, tok_s: float, ttft: float, rss: float, failed: int = 0) -> dict:
    return {
        "system": system,
        "level": level,
        "tok_s": tok_s,
        "ttft_p99_s": ttft,
        "rss_mib": rss,
        "failed": failed,
    }


@pytest.mark.timeout(10)
def test_medians_over_rounds_then_ratios_against_each_peer(bench):
    runs = [
        run("kvserve", "c1", 100, 0.20, 800), run("kvserve", "c1", 160, 0.10, 820), run("kvserve", "c1", 120, 0.30, 810),
        run("kvserve", "c32", 400, 3.0, 900), run("kvserve", "c32", 440, 2.0, 900, failed=1),
        run("kvserve", "c32", 410, 4.0, 900),
        run("llama.cpp Q8_0", "c1", 80, 0.10, 500), run("llama.cpp Q8_0", "c1", 60, 0.30, 500),
        run("llama.cpp Q8_0", "c1", 70, 0.20, 500),
        run("llama.cpp Q8_0", "c32", 200, 6.0, 600), run("llama.cpp Q8_0", "c32", 220, 5.0, 600),
        run("llama.cpp Q8_0", "c32", 180, 8.0, 600),
        run("vLLM CPU", "c32", 500, 1.0, 0),  # a peer measured at one level only, its memory not read
    ]  # fmt: skip
    medians = bench.median_results(runs)
    assert medians["kvserve"]["c1"] == {
        "tok_s": 120,
        "ttft_p99_s": 0.20,
        "rss_mib": 810,
        "failed": 0,
        "rounds": 3,
    }
    assert medians["kvserve"]["c32"]["failed"] == 1 and medians["kvserve"]["c32"]["ttft_p99_s"] == 3.0
    table = bench.ratios(medians)
    assert table["c1"] == {"llama.cpp Q8_0": {"tok_s": 1.71, "ttft_p99_s": 1.0, "rss_mib": 1.62}}
    assert table["c32"]["llama.cpp Q8_0"] == {"tok_s": 2.05, "ttft_p99_s": 0.5, "rss_mib": 1.5}
    assert table["c32"]["vLLM CPU"] == {"tok_s": 0.82, "ttft_p99_s": 3.0, "rss_mib": None}
    assert (
        bench.best_peer(medians, "c1") == "llama.cpp Q8_0" and bench.best_peer(medians, "c32") == "vLLM CPU"
    )
    assert bench.best_peer(medians, "c8") is None
    assert bench.best_peer(medians, "c32", "ttft_p99_s") == "vLLM CPU"
    assert bench.best_peer(medians, "c32", "ttft_p99_s", prefix="llama.cpp") == "llama.cpp Q8_0"
    # the README's cells: c1, c32 against llama.cpp's best; c32's TTFT p99 against its lowest; vLLM's, or -
    assert bench.table_cells(medians, table, ["c1", "c32"]) == [
        "1.71x (Q8_0)",
        "2.05x (Q8_0)",
        "0.50x (Q8_0)",
        "-",
    ]
    medians["vLLM CPU"]["c1"] = {"tok_s": 40, "ttft_p99_s": 0.1, "rss_mib": 0}
    medians["llama.cpp F16"] = {"c32": {"tok_s": 250, "ttft_p99_s": 5.5, "rss_mib": 700}}
    table = bench.ratios(medians)
    assert bench.table_cells(medians, table, ["c1", "c32"]) == [
        "1.71x (Q8_0)",  # F16 ran no c1
        "1.64x (F16)",  # the most tokens at c32: F16's 250
        "0.55x (F16)",  # the lowest TTFT p99 at c32: F16's 5.5 s
        "3.00x, 0.82x, 3.00x",
    ]
    assert bench.ratios({"llama.cpp": medians["llama.cpp Q8_0"]}) == {}  # nothing of kvserve's: no ratio


@pytest.mark.timeout(30)
def test_resident_memory_counts_every_process_of_the_servers_group(bench):
    """vLLM serves from several processes: the group's memory is theirs together, and nobody else's."""
    child = "import time; x = bytearray(64 << 20); time.sleep(30)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); {child}"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while bench.group_rss_mib(proc.pid) < 128 and time.monotonic() < deadline:
            time.sleep(0.2)
        alone = int(Path(f"/proc/{proc.pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
        together = bench.group_rss_mib(proc.pid)
        assert together >= 128 and together > alone + 60, (together, alone)
        assert bench.group_rss_mib(os.getpgid(0)) < together + 10_000  # this pytest's own group: not theirs
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.timeout(30)
def test_llama_cpps_files_are_requantized_once_and_named_by_format(bench, tmp_path):
    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_bytes(b"weights")
    quantize = tmp_path / "llama-quantize"  # stands in for llama.cpp's: records its arguments, copies
    quantize.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\ncp "$2" "$3"\n')
    quantize.chmod(0o755)
    assert bench.llama_cpp_file(gguf, "file", quantize, tmp_path) == gguf
    assert bench.llama_cpp_file(gguf, "Q4_1", quantize, tmp_path) == gguf  # the file is that format already
    made = bench.llama_cpp_file(gguf, "Q8_0", quantize, tmp_path)
    assert made == tmp_path / "models" / "Model.Q8_0.gguf" and made.read_bytes() == b"weights"
    assert bench.llama_cpp_file(gguf, "Q8_0", quantize, tmp_path) == made
    calls = (tmp_path / "calls").read_text().splitlines()
    # once, and written under another name until it is whole
    assert calls == [f"--allow-requantize {gguf} {made.with_suffix('.part')} Q8_0"]


@pytest.mark.timeout(30)
def test_each_peer_names_the_build_it_is(bench, tmp_path):
    """The summary names each peer's build: llama-server's version line (its build number and commit), vLLM's
    version from its venv's python; a binary that cannot say is "unknown", never a crash."""
    llama = tmp_path / "llama-server"  # says what llama.cpp's does, on stderr as it does
    llama.write_text(
        '#!/bin/sh\necho "version: 0.5.0-dev (build 11312, commit 0c1e57098)" >&2\necho "built with GNU"\n'
    )
    llama.chmod(0o755)
    server = bench.Server(
        "llama.cpp Q8_0", [str(llama), "-m", "x.gguf"], dict(os.environ), "http://x", tmp_path / "l"
    )
    assert bench.peer_version(server) == "version: 0.5.0-dev (build 11312, commit 0c1e57098)"
    vllm = tmp_path / "python"  # the venv's python, whose vllm says its version
    vllm.write_text("#!/bin/sh\necho vllm 0.32.0\n")
    vllm.chmod(0o755)
    server = bench.Server("vLLM CPU", [str(vllm), "-m", "vllm.entrypoints.openai.api_server"], dict(os.environ),
                          "http://x", tmp_path / "v")  # fmt: skip
    assert bench.peer_version(server) == "vllm 0.32.0"
    gone = bench.Server(
        "llama.cpp", [str(tmp_path / "missing")], dict(os.environ), "http://x", tmp_path / "m"
    )
    assert bench.peer_version(gone).startswith("unknown")
    kvserve = bench.Server(bench.KVSERVE, [sys.executable], dict(os.environ), "http://x", tmp_path / "k")
    assert bench.peer_version(kvserve) is None


@pytest.mark.timeout(30)
def test_a_server_without_usage_counts_its_text_events_as_tokens():
    """llama.cpp may stream no usage: each event that carries text is then one token (the load asks for
    ignore_eos and one token an event), so its tokens/s is not read as zero."""
    events = [{"choices": [{"text": t, "index": 0}]} for t in ("a", "b", "", "c")]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def one():
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench_http._one_request(client, "http://peer", "/v1/completions", {})

    result = asyncio.run(one())
    assert result.ok and result.output_tokens == 3 and len(result.itl) == 2


@pytest.mark.slow  # a live `kvserve serve` on a tiny GGUF: make test, not test-fast
@pytest.mark.timeout(300)
def test_the_load_against_a_live_kvserve(bench, tmp_path, byte_vocab):
    """kvserve as the script starts it (the same flags and KV sizing it gives every run), warmed, then two levels
    of the load: every request answered, tokens/s, TTFT and the server's memory read, and the server stopped."""
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, byte_vocab)
    args = argparse.Namespace(
        threads=2, kv_tokens=256, port=18700 + os.getpid() % 500, kvserve_args="--max-num-seqs 4", tier="native",
        llama_cpp=False, vllm=False, levels=[bench.Level(1, 2), bench.Level(4, 8)], prompt_words=16,
        output_tokens=8, seed=0, start_timeout=240.0,
    )  # fmt: skip
    ((server, model),) = bench.servers(args, gguf, tmp_path, tmp_path)
    assert server.name == "kvserve" and model is None
    runs = bench.measure(server, model, args, 0)
    assert [(r["system"], r["level"], r["round"], r["failed"]) for r in runs] == [
        ("kvserve", "c1", 1, 0),
        ("kvserve", "c4", 1, 0),
    ]
    assert all(r["tok_s"] > 0 and r["ttft_p99_s"] > 0 and r["rss_mib"] > 100 for r in runs), runs
    log = server.log.read_text()
    assert "KV cache: 16 blocks of 16 tokens" in log, log[-2000:]  # --kv-tokens 256, as llama.cpp's -c 256
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)  # stopped
