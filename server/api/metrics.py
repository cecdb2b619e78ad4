"""Prometheus metrics, named like vLLM's with a `kvserve:` prefix and labelled with the served model name.

The engine's gauges and counters are also exported under vLLM's own names (`vllm:*`, see _vllm_families),
which is what the routers and gateways in front of vLLM fleets read: llm-d's endpoint picker, vLLM's
production-stack router, dashboards. Latency histograms are observed per request by the serving functions. Gauges and token/cache counters are
read from the engine's cumulative stats at scrape time, so they are exact without any bookkeeping here.
Each app has its own registry, so several apps can live in one process (tests).
"""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.engine.async_engine import AsyncEngine
from server.engine.request import RequestTimes
from server.engine.stats import EngineStats

PREFIX = "kvserve:"
VLLM_PREFIX = "vllm:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                     0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip


class Metrics:
    def __init__(self, model_name: str, get_engine: Callable[[], AsyncEngine | None]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, get_engine))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between output tokens of a request.", TOKEN_GAP_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last output token.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", LATENCY_BUCKETS
        )
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests (one per choice), by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name

    def request_finished(self, finish_reason: str, times: RequestTimes | None) -> None:
        self._request_success.labels(self._model_name, finish_reason).inc()
        if times is None:  # aborted before the engine reported back (client gone)
            return
        if times.scheduled is not None:
            self.request_queue_time.observe(times.scheduled - times.arrival)
        if times.first_token is not None:
            self.time_to_first_token.observe(times.first_token - times.arrival)
        if times.finish is not None:
            self.e2e_request_latency.observe(times.finish - times.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine state at scrape time: gauges, and the engine's own cumulative counters; each twice, under
    kvserve's names and under vLLM's."""

    def __init__(self, model_name: str, get_engine: Callable[[], AsyncEngine | None]):
        self.model_name = model_name
        self.get_engine = get_engine

    def collect(self):
        engine = self.get_engine()
        s = engine.stats() if engine is not None else EngineStats()
        gauges = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Share of KV-cache blocks held by requests (0-1).", s.kv_cache_usage),
            (
                "kv_cache_resident_bytes",
                "Bytes of the KV cache's pool in memory: on CPU the blocks written since start (held as first "
                "written, reused, never given back), on a GPU the whole pool.",
                s.kv_cache_resident_bytes,
            ),
        ]
        if s.num_state_slots:  # a hybrid model's other pools
            gauges += [
                (
                    "state_slots_usage_perc",
                    "Share of the running sequences' DeltaNet state slots held (0-1).",
                    s.num_state_slots_used / s.num_state_slots,
                ),
                (
                    "state_snapshots_usage_perc",
                    "Share of the DeltaNet state snapshot slots the prefix cache holds (0-1).",
                    s.num_snapshots_cached / s.num_snapshots if s.num_snapshots else 0.0,
                ),
            ]
        counters = [
            ("prompt_tokens", "Prompt tokens of admitted requests.", s.num_prompt_tokens),
            ("generation_tokens", "Generated tokens.", s.num_generation_tokens),
            (
                "pooled_requests",
                "Prefill-only requests (embeddings, scores) finished.",
                s.num_pooled_requests,
            ),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted to free KV-cache blocks.", s.num_preemptions),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        yield from _vllm_families(self.model_name, s)


def _vllm_families(model_name: str, s: EngineStats):
    """The series the routers read, named and labelled as vLLM (v1) names them, `engine` label included.
    llm-d's endpoint picker reads the three gauges and cache_config_info's block_size and num_gpu_blocks
    labels (the KV capacity); the production-stack router reads the older names gpu_cache_usage_perc and
    gpu_prefix_cache_{queries,hits}_total, which vLLM v1 still exports beside the new ones."""
    labels, values = ["model_name", "engine"], [model_name, "0"]
    gauges = [
        ("num_requests_running", "Requests in the running batch.", s.num_running),
        ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
        ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv_cache_usage),
        ("gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent (older name).", s.kv_cache_usage),
    ]
    counters = [
        ("prompt_tokens", "Prompt tokens of admitted requests.", s.num_prompt_tokens),
        ("generation_tokens", "Generated tokens.", s.num_generation_tokens),
        ("num_preemptions", "Requests preempted to free KV-cache blocks.", s.num_preemptions),
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        ("gpu_prefix_cache_queries", "Prefix cache queries, in tokens (older name).", s.prefix_cache_queries),
        ("gpu_prefix_cache_hits", "Prefix cache hits, in tokens (older name).", s.prefix_cache_hits),
        ("spec_decode_num_drafts", "Decodes verified with speculative drafts.", s.num_drafts),
        ("spec_decode_num_draft_tokens", "Speculative draft tokens verified.", s.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Speculative draft tokens kept.", s.num_accepted_tokens),
    ]
    for name, doc, value in gauges:
        family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    for name, doc, value in counters:
        family = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    per_position = CounterMetricFamily(
        VLLM_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Speculative draft tokens kept, by their position among a decode's drafts (0 = the first).",
        labels=[*labels, "position"],
    )
    for position, count in sorted(s.accepted_per_position.items()):
        per_position.add_metric([*values, str(position)], count)
    yield per_position
    info = GaugeMetricFamily(
        VLLM_PREFIX + "cache_config_info",
        "The KV cache's configuration, in the labels (value 1).",
        labels=["engine", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
    )
    if s.num_blocks:  # not before the model has loaded and sized its cache
        info.add_metric(
            ["0", str(s.block_size), str(s.num_blocks), s.kv_cache_dtype, str(s.enable_prefix_caching)], 1
        )
    yield info
