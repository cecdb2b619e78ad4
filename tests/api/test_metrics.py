"""/metrics parses with prometheus-client's own parser, and the counters move by exactly what was served."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(60)

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = [
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
]


def test_every_metric_is_there_with_its_type_and_model_label(tiny_engine, start_server):
    url, _ = start_server(tiny_engine)
    httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    r = httpx.get(f"{url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    expected = {"histogram": HISTOGRAMS, "gauge": GAUGES, "counter": COUNTERS}
    for kind, names in expected.items():
        for name in names:
            family = families[f"kvserve:{name}"]
            assert family.type == kind
            assert family.samples and all(s.labels["model_name"] == "test-model" for s in family.samples)


def test_counters_move_by_the_right_amounts(tiny_engine, start_server, scrape):
    url, _ = start_server(tiny_engine)
    prompt = "the quick brown fox jumps over the lazy dog " * 2  # a few full KV blocks, for the prefix cache
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    before = scrape(url, idle=True)
    first = httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
    second = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 3}).json()["usage"]
    after = scrape(url, idle=True)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert moved("kvserve:prompt_tokens_total") == first["prompt_tokens"] + second["prompt_tokens"]
    assert (
        moved("kvserve:generation_tokens_total")
        == first["completion_tokens"] + second["completion_tokens"]
        == 8
    )
    assert moved("kvserve:request_success_total{length}") == 2
    assert moved("kvserve:request_success_total{stop}") == 0
    for name in ["time_to_first_token", "e2e_request_latency", "request_queue_time"]:
        assert moved(f"kvserve:{name}_seconds_count") == 2
    assert moved("kvserve:inter_token_latency_seconds_count") == (5 - 1) + (3 - 1)
    # the second request found the first one's full prompt blocks
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16
    assert moved("kvserve:prefix_cache_hits_total") == cached
    assert moved("kvserve:prefix_cache_queries_total") >= cached
    assert moved("kvserve:num_preemptions_total") == 0
    assert after["kvserve:num_requests_running"] == after["kvserve:num_requests_waiting"] == 0
    assert after["kvserve:kv_cache_usage_perc"] == 0


def test_apps_have_their_own_registries(tiny_engine, start_server, scrape):
    url_a, _ = start_server(tiny_engine, served_model_name="a")
    url_b, _ = start_server(tiny_engine, served_model_name="b")
    httpx.post(f"{url_a}/v1/completions", json={"prompt": "a", "max_tokens": 2, "model": "a"})
    assert (
        sum(v for k, v in scrape(url_a, idle=True).items() if k.startswith("kvserve:request_success_total"))
        == 1
    )
    assert sum(v for k, v in scrape(url_b).items() if k.startswith("kvserve:request_success_total")) == 0
    assert 'model_name="b"' in httpx.get(f"{url_b}/metrics").text
