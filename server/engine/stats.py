"""Plain snapshots of engine state for the metrics layer (which alone knows Prometheus)."""

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by live requests (cached free blocks count as free)
    # the KV cache's shape, fixed once the model has loaded (0 before)
    num_blocks: int = 0
    block_size: int = 0
    num_blocks_touched: int = 0  # blocks handed out at least once since start
    # bytes of the K/V pools the process holds: on CPU the blocks touched (model/kv_cache.py), on a GPU it all
    kv_cache_resident_bytes: int = 0
    kv_cache_dtype: str = ""  # "bfloat16" (every CPU tier by default), or what --kv-cache-dtype asked for
    enable_prefix_caching: bool = False
    # cumulative counters since start
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_prompt_tokens: int = 0  # prompt tokens of requests admitted (counted once per request)
    num_generation_tokens: int = 0
    num_pooled_requests: int = 0  # prefill-only requests (embeddings, scores) finished with their vector
    num_preemptions: int = 0
    num_steps: int = 0
    # a hybrid model's DeltaNet states (0 for other models): running sequences' slots, and snapshots for the
    # prefix cache, each pool's size and what is held
    num_state_slots: int = 0
    num_state_slots_used: int = 0
    num_snapshots: int = 0
    num_snapshots_cached: int = 0
    # speculative decoding: decodes verified with drafts, their drafts, the drafts kept, kept by draft position
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: dict[int, int] = field(default_factory=dict)
