"""What the engine decides once, at start: the backend (device, CPU tier, kernels, dtype, weight format), the KV
cache's size and layout, and the context length.

build_runner() makes every choice here, in this order, and hands the ModelRunner what it chose; nothing is
switched later. What depends on the device is the backend's (server/engine/backend.py).
"""

import logging
from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.loader import load_model, model_name
from server.engine.backend import dtype_name, select_backend
from server.engine.block_manager import blocks_for
from server.engine.config import EngineConfig, SpeculativeConfig
from server.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def build_runner(model, config: EngineConfig) -> ModelRunner:
    """The runner of `model`: a Hugging Face folder's path, or a source its caller opened (model/loader.py)."""
    backend = select_backend(config, model)
    log.info("loading %s on %s in %s", model_name(model), backend.device, dtype_name(backend.dtype))
    model, model_config = load_model(model, backend.dtype, backend.device, backend.ops)
    backend.log_gemms(model)
    batch_invariant = backend.batch_invariant(model)
    kv_dtype = backend.kv_cache_dtype(config.kv_cache_dtype)
    budget = backend.kv_cache_budget(config)
    drafts, spare = max_step_drafts(config, batch_invariant), backend.spare_state_slots(model_config, config)
    layout = cache_layout(model_config, config, kv_dtype, budget, drafts, spare)
    kv_cache = KVCache(
        model_config,
        layout.num_blocks,
        config.block_size,
        kv_dtype,
        backend.device,
        layout.num_state_slots,
        layout.num_snapshots,
        layout.num_draft_slots,
        spare,
    )
    attention = backend.attention(model_config, config.block_size, layout.num_blocks)
    backend.ready(model)
    graphs = backend.decode_graphs(model, kv_cache, attention, config)
    prompt_gemms = backend.prompt_gemms(model, config)
    return ModelRunner(
        model, model_config, kv_cache, attention, backend, batch_invariant, graphs, prompt_gemms
    )


def max_step_drafts(config: EngineConfig, batch_invariant: bool) -> int:
    """The most drafts one step may verify under config.speculative ("auto" as select_speculation resolves it)."""
    spec = config.speculative
    if spec == "auto":
        spec = SpeculativeConfig() if batch_invariant else None
    return spec.max_step_rows - 1 if isinstance(spec, SpeculativeConfig) else 0


def select_speculation(runner: ModelRunner) -> SpeculativeConfig | None:
    """--speculative-config auto: n-gram drafts where every step op is batch-invariant, so that a drafted token
    is kept exactly when plain decoding would have produced it; off elsewhere. Logged with why."""
    if runner.batch_invariant:
        log.info(
            "speculative decoding: n-gram drafts (auto: this run's steps are batch-invariant, so the output "
            "is the same with or without them; --speculative-config off turns them off)"
        )
        return SpeculativeConfig()
    log.info(
        "speculative decoding: off (auto: this run's steps are not batch-invariant, so drafts could change "
        "the output)"
    )
    return None


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache's budget shared out: K/V blocks and, for a hybrid model's DeltaNet layers, state slots."""

    num_blocks: int
    num_state_slots: int = 0  # one per running sequence: the most sequences a hybrid runs at once
    num_snapshots: int = 0  # states kept at block boundaries, for its prefix cache
    num_draft_slots: int = (
        0  # a step's states after each token of its decodes' drafts: the most drafts a step has
    )


# The most of the KV cache's budget a hybrid's DeltaNet states take: its running sequences', its prefix cache's
# snapshots, a step's drafts'. K/V keep the rest, at least KV_SHARE.
RUNNING_STATES_SHARE, SNAPSHOTS_SHARE, DRAFT_STATES_SHARE = 0.4, 0.25, 0.1
KV_SHARE = 1 - RUNNING_STATES_SHARE - SNAPSHOTS_SHARE - DRAFT_STATES_SHARE


def cache_layout(
    model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, budget: int, max_drafts: int = 0,
    spare_states: int = 0,
) -> CacheLayout:  # fmt: skip
    """What `budget` bytes hold. A hybrid's running states take at most 40% of it (fewer sequences than
    --max-num-seqs where they would take more: a 35B-A3B's state is 61 MiB a sequence), its snapshots at most a
    quarter, four per running sequence at most (a prompt's, a reply's, a shared prefix's), and the states of a
    step's drafts (max_drafts, where it drafts) at most a tenth; spare_states (a CUDA graph's padded rows') come
    out of K/V's share; K/V the rest."""
    per_block = KVCache.bytes_per_block(model_config, config.block_size, dtype)
    per_state = KVCache.bytes_per_state_slot(model_config)
    num_state_slots = num_snapshots = num_draft_slots = 0
    if per_state:
        num_state_slots = min(config.max_num_seqs, max(1, int(budget * RUNNING_STATES_SHARE) // per_state))
        if config.enable_prefix_caching:
            num_snapshots = min(4 * num_state_slots, int(budget * SNAPSHOTS_SHARE) // per_state)
        num_draft_slots = min(max_drafts, int(budget * DRAFT_STATES_SHARE) // per_state)
        log.info(
            "DeltaNet state (%.1f MiB a sequence, float32): %d running sequences%s, %d snapshots for the prefix "
            "cache, %d for a step's drafts; %.2f GiB of the KV cache's budget",
            per_state / 2**20,
            num_state_slots,
            f" (not --max-num-seqs {config.max_num_seqs}: 40% of the budget)"
            if num_state_slots < config.max_num_seqs
            else "",
            num_snapshots,
            num_draft_slots,
            (num_state_slots + num_snapshots + num_draft_slots) * per_state / 2**30,
        )
    state_bytes = (num_state_slots + num_snapshots + num_draft_slots + spare_states) * per_state
    num_blocks = (budget - state_bytes) // per_block
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes"
            + (f" after {state_bytes} bytes of DeltaNet state" if state_bytes else "")
        )
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %s), a block %d rows of K/V (a layer's each, or narrower ones side by side); %s",
        num_blocks,
        config.block_size,
        num_blocks * per_block / 2**30,
        dtype_name(dtype),
        model_config.kv_page_rows,
        describe_kv_groups(model_config),
    )
    return CacheLayout(num_blocks, num_state_slots, num_snapshots, num_draft_slots)


def describe_kv_groups(model_config: ModelConfig) -> str:
    """What each kind of attention layer keeps, for the start log: "3 full-attention layers in 1 group, 15
    sliding-window (512) layers in 5 groups (blocks behind the window freed)"."""
    kinds: dict[int | None, list] = {}
    for group in model_config.kv_groups:
        kinds.setdefault(group.window, []).append(group)
    heads = "" if model_config.uniform_kv else " of {} KV heads x {}"
    readers = sum(spec.kv_source >= 0 for spec in model_config.layers)
    return ", ".join(
        f"{sum(len(g.layers) for g in groups)} "
        + ("full-attention" if window is None else f"sliding-window ({window})")
        + " layers"
        + heads.format(groups[0].num_kv_heads, groups[0].head_dim)
        + f" in {len(groups)} group{'s' if len(groups) > 1 else ''}"
        + ("" if window is None else " (blocks behind the window freed)")
        for window, groups in kinds.items()
    ) + (f"; {readers} layers read an earlier layer's K/V" if readers else "")


def context_length(model_config: ModelConfig, config: EngineConfig, num_blocks: int) -> int:
    """The most tokens (prompt + output) one request may hold: the model's context, --max-model-len, and
    what the cache holds, whichever is least."""
    model_len = model_config.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > model_len:
            log.warning(
                "--max-model-len %d is beyond the model's context %d", config.max_model_len, model_len
            )
        model_len = config.max_model_len
    windows = model_config.kv_group_windows

    def fits(num_tokens: int) -> bool:
        return blocks_for(windows, config.block_size, num_tokens, config.max_num_batched_tokens) <= num_blocks

    if not fits(model_len):
        low, high = 0, model_len  # fits(low), not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        log.warning("context capped to %d tokens: the KV cache holds no more for one sequence", low)
        model_len = low
    return model_len
