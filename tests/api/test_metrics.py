"""/metrics parses with prometheus-client's own parser, and the counters move by exactly what was served."""

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model import cpu_tier
from server.engine.config import SpeculativeConfig

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


def test_the_kv_caches_resident_bytes_are_the_blocks_written_so_far(tiny_engine, start_server, scrape):
    url, _ = start_server(tiny_engine)
    cache = tiny_engine._engine.runner.kv_cache
    per_block = (cache.k.nbytes + cache.v.nbytes) // cache.num_blocks
    before = scrape(url, idle=True)["kvserve:kv_cache_resident_bytes"]
    prompt = " ".join(f"w{i}" for i in range(30))  # a prompt no earlier test sent
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    usage = httpx.post(f"{url}/v1/completions", json=body).json()["usage"]
    after = scrape(url, idle=True)["kvserve:kv_cache_resident_bytes"]
    stats = tiny_engine.stats()
    assert after == stats.num_blocks_touched * per_block
    # the pool holds at least this request's blocks, and on CPU not the blocks nobody has written yet
    assert stats.num_blocks_touched >= -(-usage["total_tokens"] // stats.block_size)
    assert before <= after < cache.num_blocks * per_block


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


def test_vllm_named_series_the_routers_read(tiny_engine, tiny_llama_dir, start_server, scrape):
    """Every series under vLLM's name carries the value of kvserve's own, with vLLM's labels; the cache
    config holds the engine's real KV-cache shape (llm-d's endpoint picker reads the capacity from it)."""
    url, _ = start_server(tiny_engine)
    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 2, "max_tokens": 3, "temperature": 0}
    before = scrape(url, idle=True)
    for _ in range(2):  # the second finds the first one's blocks
        httpx.post(f"{url}/v1/completions", json=body)
    samples = scrape(url, idle=True)
    mirrored = {
        "num_requests_running": "num_requests_running",
        "num_requests_waiting": "num_requests_waiting",
        "kv_cache_usage_perc": "kv_cache_usage_perc",
        "gpu_cache_usage_perc": "kv_cache_usage_perc",
        "prompt_tokens_total": "prompt_tokens_total",
        "generation_tokens_total": "generation_tokens_total",
        "num_preemptions_total": "num_preemptions_total",
        "prefix_cache_queries_total": "prefix_cache_queries_total",
        "prefix_cache_hits_total": "prefix_cache_hits_total",
        "gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
        "gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
    }
    for vllm_name, own in mirrored.items():
        assert samples[f"vllm:{vllm_name}{{0}}"] == samples[f"kvserve:{own}"], vllm_name
    moved = {
        k: samples[k] - before[k]
        for k in ("vllm:gpu_prefix_cache_hits_total{0}", "vllm:generation_tokens_total{0}")
    }
    assert moved["vllm:gpu_prefix_cache_hits_total{0}"] >= 16
    assert moved["vllm:generation_tokens_total{0}"] == 6

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    assert families["vllm:num_requests_waiting"].type == "gauge"
    assert families["vllm:gpu_prefix_cache_hits"].type == "counter"
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_prefix_cache_queries"):
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": "test-model", "engine": "0"}
    (info,) = families["vllm:cache_config_info"].samples
    # the engine's 64 MiB cache, in blocks of 16 tokens: K and V, per layer, per KV head, in the dtype the engine
    # chose (its CPU tier's)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    itemsize = {"bfloat16": 2, "float32": 4}[info.labels["cache_dtype"]]
    assert info.labels["cache_dtype"] == str(cpu_tier.select()[0].kv_dtype).removeprefix("torch.")
    block_bytes = 2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"] * head_dim * itemsize
    assert info.value == 1
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str((64 << 20) // block_bytes)
    assert info.labels["enable_prefix_caching"] == "True"


def test_routes_the_routers_poll(tiny_engine, start_server):
    url, _ = start_server(tiny_engine, served_model_name="fleet-model")
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.get(f"{url}/server_info").json() == {"served_model_name": "fleet-model"}
    # while the model loads: not asleep, and /health (what the routers route by) says 503
    loading, _ = start_server(None)
    assert httpx.get(f"{loading}/is_sleeping").json() == {"is_sleeping": False}
    assert httpx.get(f"{loading}/health").status_code == 503
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{loading}/metrics").text)}
    assert families["vllm:cache_config_info"].samples == [], "no cache shape before the cache exists"


def test_responses_and_messages_are_counted_like_the_others(tiny_engine, start_server, scrape):
    url, _ = start_server(tiny_engine)
    before = scrape(url, idle=True)
    r = httpx.post(
        f"{url}/v1/responses", json={"input": "a", "max_output_tokens": 3, "ignore_eos": True}
    ).json()
    m = httpx.post(
        f"{url}/v1/messages",
        json={
            "messages": [{"role": "user", "content": "a"}],
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
        },
    )
    assert m.status_code == 200
    after = scrape(url, idle=True)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert moved("kvserve:request_success_total{length}") == 2
    assert moved("kvserve:generation_tokens_total") == r["usage"]["output_tokens"] + 4 == 7
    assert moved("kvserve:time_to_first_token_seconds_count") == 2
    assert moved("kvserve:inter_token_latency_seconds_count") == (3 - 1) + (4 - 1)


def test_speculative_decoding_is_counted_in_vllms_names(tiny_llama_dir, new_engine, start_server, scrape):
    """Drafts, draft tokens and kept drafts (also by position) under vLLM's spec_decode names; a request that
    opts out drafts nothing."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    url, _ = start_server(new_engine(tiny_llama_dir, kv_cache_memory=64 << 20, speculative=spec))
    body = {"prompt": "a b a b a b a b", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json={**body, "speculative": False}).status_code == 200
    quiet = scrape(url, idle=True)
    assert quiet["vllm:spec_decode_num_drafts_total{0}"] == 0
    plain = httpx.post(f"{url}/v1/completions", json={**body, "speculative": False}).json()
    drafted = httpx.post(f"{url}/v1/completions", json=body).json()
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
    samples = scrape(url, idle=True)
    drafts = samples["vllm:spec_decode_num_drafts_total{0}"]
    tokens = samples["vllm:spec_decode_num_draft_tokens_total{0}"]
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total{0}"]
    per_position = [
        samples.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{0,{i}}}", 0) for i in range(3)
    ]
    assert 0 < drafts <= tokens <= 3 * drafts and 0 < accepted <= tokens
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    # kept drafts are generated tokens like any other: 40 for each request
    assert samples["vllm:generation_tokens_total{0}"] - quiet["vllm:generation_tokens_total{0}"] == 80


@pytest.mark.timeout(180)
def test_a_hybrid_models_state_pools_and_its_prefix_hits(
    tiny_model_factory, new_engine, start_server, scrape
):
    """A hybrid model (DeltaNet states beside the KV cache) shows its two other pools, and a prompt that extends
    an earlier one is served from the prefix cache as a client sees it: usage's cached_tokens is the earlier
    prompt's full blocks (its state was kept at their end)."""
    from tests.helpers.tiny_models import tiny_family

    url, _ = start_server(new_engine(tiny_family(tiny_model_factory, "qwen3_5"), max_num_seqs=4))
    idle = scrape(url, idle=True)
    assert idle["kvserve:state_slots_usage_perc"] == 0 and idle["kvserve:state_snapshots_usage_perc"] == 0
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    earlier = list(range(40, 90))  # 50 tokens: 3 full blocks of 16
    first = httpx.post(f"{url}/v1/completions", json={**body, "prompt": earlier}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = httpx.post(f"{url}/v1/completions", json={**body, "prompt": earlier + [7, 8, 9]}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    samples = scrape(url, idle=True)
    assert samples["kvserve:state_slots_usage_perc"] == 0  # every running state given back
    assert 0 < samples["kvserve:state_snapshots_usage_perc"] <= 1
    assert samples["kvserve:prefix_cache_hits_total"] == 48
