"""`kvserve chat` and `kvserve bench` against a live server, run as a user would."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_chat_streams_answers_and_keeps_the_conversation(start_server, tiny_engine):
    url, _ = start_server(tiny_engine)
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "chat", "--url", url, "--max-tokens", "6", "--temperature", "0"],
        input="hello there\nand again\n\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "chatting with test-model" in out.stdout
    assert out.stdout.count("> ") >= 3  # two turns answered, then the empty line ends it
    assert "error" not in out.stdout


def run_bench(url: str, *flags: str) -> dict:
    """`kvserve bench` as a user runs it; its last line, the JSON summary."""
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "bench", "--url", url, *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_bench_reports_every_request_and_a_json_line(start_server, tiny_engine):
    url, _ = start_server(tiny_engine)
    summary = run_bench(
        url, "--concurrency", "4", "--num-requests", "12", "--input-len", "16", "--output-len", "8"
    )
    assert summary["requests_ok"] == 12 and summary["requests_failed"] == 0
    assert summary["output_tokens_per_s"] > 0
    assert summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    assert summary["decode_tokens_per_s_per_stream"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_with_a_duration_keeps_sending_until_it_is_over(start_server, tiny_engine):
    """`--duration` alone is a time-boxed run: requests keep starting until the time is up, then those in
    flight finish."""
    url, _ = start_server(tiny_engine)
    # one-token answers to two-word prompts: hundreds fit in 6 s even on a loaded 2-core machine
    summary = run_bench(url, "--concurrency", "4", "--duration", "6", "--input-len", "2", "--output-len", "1")
    assert summary["wall_s"] >= 6
    assert summary["requests_ok"] > 64 and summary["requests_failed"] == 0  # more than the count default


@pytest.mark.timeout(180)
def test_bench_shared_prefix_is_found_in_the_servers_prefix_cache(start_server, tiny_engine):
    """With --shared-prefix-len every prompt starts with one of the shared prefixes: after its first use,
    the server finds it in its prefix cache (the summary reads usage's cached_tokens); without, nothing is."""
    url, _ = start_server(tiny_engine)
    common = ["--concurrency", "1", "--num-requests", "8", "--input-len", "2", "--output-len", "2"]
    distinct = run_bench(url, *common, "--seed", "11")
    shared = run_bench(
        url, *common, "--seed", "12", "--shared-prefix-len", "24", "--num-shared-prefixes", "2"
    )
    assert distinct["requests_ok"] == shared["requests_ok"] == 8
    assert distinct["cached_prompt_share"] < 0.05
    # the prefix is ~90% of a prompt (the tiny model's context is 256 tokens): 2 first uses, then 6 hits
    assert shared["cached_prompt_share"] > 0.4


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("workload", ["chat", "json"])
def test_bench_chat_workloads_stream_chat_completions(start_server, tiny_engine, workload):
    """The chat workloads (here the two whose prompts fit the tiny model's 256 tokens) go through
    /v1/chat/completions, each request to its end: the summary counts the tokens usage reports."""
    url, _ = start_server(tiny_engine)
    summary = run_bench(
        url, "--workload", workload, "--concurrency", "2", "--num-requests", "4", "--output-len", "8"
    )
    assert summary["workload"] == workload
    assert summary["requests_ok"] == 4 and summary["requests_failed"] == 0
    assert summary["output_tokens_per_s"] > 0 and summary["ttft_s"]["p50"] is not None


@pytest.mark.timeout(180)
def test_bench_turns_sends_each_conversations_history_and_reports_ttft_by_turn(start_server, tiny_engine):
    """--workload turns: conversations of three chat requests, each sending the history back (the earlier
    messages and the replies as streamed); later turns find most of their prompt in the prefix cache."""
    url, _ = start_server(tiny_engine)
    summary = run_bench(url, "--workload", "turns", "--num-turns", "3", "--concurrency", "2",
                        "--num-requests", "6", "--input-len", "12", "--turn-len", "3", "--output-len", "6")  # fmt: skip
    assert summary["requests_ok"] == 6 and summary["requests_failed"] == 0
    assert set(summary["ttft_by_turn_s"]) == {"1", "2", "3"}
    cached = summary["cached_prompt_share_by_turn"]
    assert cached["1"] < 0.2 and cached["2"] > 0.4 and cached["3"] > 0.4, cached


def test_bench_shared_prefixes_start_every_prompt():
    import random

    from server.bench.http import shared_prefixes

    prefixes = shared_prefixes(random.Random(0), 3, 20)
    assert len(set(prefixes)) == 3 and all(len(p.split()) == 20 and p.endswith("\n") for p in prefixes)
    assert shared_prefixes(random.Random(0), 3, 0) == [""]
