"""What the engine decides once, at start: device, CPU tier, kernels, dtype, weight format, KV-cache size and
context length.

build_runner() makes every choice here, in this order, and hands the ModelRunner what it chose; nothing is
switched later.
"""

import enum
import logging
import os
import time
from dataclasses import dataclass

import torch

from model import cpu_tier, kernels
from model.attention import TorchAttention, min_query_len_for_invariance
from model.attention_cpu import CpuKernelAttention
from model.config import ModelConfig
from model.cpu_tier import CpuTier
from model.huge_pages import on_huge_pages
from model.kv_cache import KVCache
from model.linear import Linear, OneDnnLinear, PlainLinear
from model.loader import load_model, model_name, stores_quantized
from model.quant import QuantizedLinear
from model.sampling import TORCH_SAMPLER, SamplerKernels
from model.transformer import Ops
from server.engine.block_manager import blocks_for
from server.engine.config import EngineConfig, SpeculativeConfig
from server.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# default cache on CPU: 2 GiB, zeroed (so resident) at start: a machine short of memory fails then, not under load
CPU_KV_CACHE_BYTES = 2 << 30


class WeightFormat(enum.Enum):
    """How the weights run."""

    DENSE = "dense"  # in the model's dtype; a checkpoint's quantized weights dequantized at load
    STORED = "as stored"  # a checkpoint's quantized weights kept so, on kvserve's quantized GEMMs
    INT8 = "int8"  # dense weights quantized at load, to 8 or 4 bits
    INT4 = "int4"

    @property
    def quantize_to(self) -> int | None:
        """The bits dense weights are quantized to at load (None: they stay dense)."""
        return {WeightFormat.INT8: 8, WeightFormat.INT4: 4}.get(self)


def build_runner(model, config: EngineConfig) -> ModelRunner:
    """The runner of `model`: a Hugging Face folder's path, or a source its caller opened (model/loader.py)."""
    bound_onednn_caches()
    device = select_device(config.device)
    tier = select_cpu_tier(config.cpu_tier, device, config.cpu_kernels)
    cpu_kernels = select_cpu_kernels(config.cpu_kernels, device, tier)
    dtype = select_dtype(config.dtype, device, tier)
    weights = select_quantization(config, device, cpu_kernels, model, dtype)
    # A request's tokens must not depend on its batch. CPU GEMMs may switch kernels (summation orders) for
    # small row counts: the GEMMs that do pad small batches (measured per weight shape at load). By default
    # for 16-bit dtypes (the avx512bf16 tier), where it is nearly free, not for float32, where more GEMMs pad.
    # The quantized GEMMs are batch-invariant as they are.
    invariant = config.batch_invariant if config.batch_invariant is not None else dtype != torch.float32
    invariant = invariant and device.type == "cpu"
    dense = OneDnnLinear if OneDnnLinear.available(dtype, device) else PlainLinear
    linear = dense(batch_invariant=invariant)
    activations = ""
    if weights is not WeightFormat.DENSE:
        int8 = select_gemm_activations(config.gemm_activations, cpu_kernels, dtype)
        linear = QuantizedLinear(cpu_kernels, linear, weights.quantize_to, int8_activations=int8)
        rounded = "rounded to int8 per 32" if int8 else "the tier's own"
        activations = f"the quantized ones' activations {rounded}; "
    ops = Ops.with_kernels(linear, cpu_kernels)
    log.info("loading %s on %s in %s", model_name(model), device, str(dtype).removeprefix("torch."))
    model, model_config = load_model(model, dtype, device, ops)
    log.info(
        "GEMMs: %s%s%s%s; attention and RMSNorm: %s",
        activations,
        describe_weights(model) if weights is not WeightFormat.DENSE else "",
        "weights packed for oneDNN" if dense is OneDnnLinear else "F.linear",
        ", small batches padded for batch invariance" if invariant else "",
        "kvserve's C++ CPU kernels" if cpu_kernels else "PyTorch ops",
    )
    # Every step op batch-invariant: GEMMs padded or all quantized (the kernel is invariant as it is), attention
    # by the kernel or padded. On GPUs kvserve does not make them so.
    gemms_invariant = invariant or all(
        getattr(m, "bits", None) for m in model.modules() if isinstance(m, Linear)
    )
    batch_invariant = device.type == "cpu" and gemms_invariant and (cpu_kernels is not None or invariant)
    kv_dtype = select_kv_cache_dtype(config.kv_cache_dtype, dtype, tier)
    layout = cache_layout(model_config, config, kv_dtype, device, max_step_drafts(config, batch_invariant))
    num_blocks = layout.num_blocks
    kv_cache = KVCache(
        model_config,
        num_blocks,
        config.block_size,
        kv_dtype,
        device,
        layout.num_state_slots,
        layout.num_snapshots,
        layout.num_draft_slots,
    )
    if cpu_kernels is not None:  # batch-invariant as it is
        attention = CpuKernelAttention(cpu_kernels, config.block_size)
    else:
        mc = model_config
        min_query_len = (
            min_query_len_for_invariance(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, device)
            if invariant
            else 1
        )
        attention = TorchAttention(
            config.block_size,
            mc.num_kv_heads,
            num_blocks,
            device,
            mc.kv_group_windows,
            min_query_len,
        )
        log.info("attention pads queries to %d", min_query_len)
    # the sampler's noise and argmax: the kernels' bits are PyTorch's
    sampler = TORCH_SAMPLER
    if cpu_kernels is not None:
        sampler = SamplerKernels(cpu_kernels.uniform_noise, cpu_kernels.argmax_rows)
    return ModelRunner(model, model_config, kv_cache, attention, device, dtype, sampler, batch_invariant)


def move_to_huge_pages(model: torch.nn.Module) -> None:
    """The weights every step streams, onto 2 MiB pages (model/huge_pages.py), before the first step. The
    quantized weights are packed onto them already (model/csrc/quant_pack.cpp, an MoE layer's experts too): what
    is left to copy is the rest (dense weights, scales, a packed weight's last partial frame), 0.1-0.7 s of the
    start for the default model, Qwen3.5 ~1.5B and the GPT-OSS, OLMoE and Qwen3.6 cuts (Zen 4). It used to run on
    a thread of its own, a frame at each of the engine's quiet moments, when the experts were still to copy (2.2
    GB of the Qwen3.6 cut, ~5 s of a core): beside the first minute's requests it still took a core's share, and
    that cut's c1 ran at 67-74 tok/s against 76-81 once it was done (forced AVX2)."""
    start = time.monotonic()
    moved = on_huge_pages([*model.parameters(), *model.buffers()])
    log.info("%.2f GiB of weights on 2 MiB pages (%.1f s)", moved / 2**30, time.monotonic() - start)


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


def select_cpu_tier(name: str, device: torch.device, kernels_mode: str) -> CpuTier | None:
    """The CPU tier to run as (model/cpu_tier.py), logged with why; None off the CPU. `auto` on a CPU better
    than the one the install built for (an image built elsewhere) takes the best tier it built, and says so."""
    if device.type != "cpu":
        return None
    tier, why = cpu_tier.select(name)
    if name == "auto" and kernels_mode != "off" and not kernels.built(tier):
        have = cpu_tier.runnable()
        fallback = next((t for t in have[have.index(tier) :] if kernels.built(t)), None)
        if fallback is not None:
            log.warning(
                "the %s tier's kernels are not built here: run %s to build them",
                tier.name,
                kernels.build_command(tier.name),
            )
            tier, why = (
                fallback,
                f"{tier.name} would be, but this install built the kernels for {fallback.name}",
            )
    log.info("CPU tier %s (%s): %s", tier.name, why, tier.summary)
    return tier


def select_quantization(
    config: EngineConfig, device: torch.device, cpu_kernels, model, dtype: torch.dtype
) -> WeightFormat:
    """How the weights run, from --quantization (auto: a checkpoint's quantized weights as stored, where the
    quantized GEMMs can run, else dense)."""
    mode, quantized_file = config.quantization, stores_quantized(model)
    if mode not in ("auto", "none", "int8", "int4"):
        raise ValueError(f"unknown --quantization {mode!r}: use auto, none, int8 or int4")
    if mode == "none":
        return WeightFormat.DENSE
    why_not = None
    if device.type != "cpu":
        why_not = "the quantized GEMMs are CPU kernels"
    elif cpu_kernels is None:
        why_not = "the C++ CPU kernels are off or could not be built"
    elif dtype not in (torch.float32, torch.bfloat16):
        why_not = f"the quantized GEMMs take float32 or bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
    if why_not and mode != "auto":
        raise ValueError(f"--quantization {mode}: {why_not}")
    if why_not:
        if quantized_file:
            log.warning("serving the quantized weights of %s dequantized: %s", model_name(model), why_not)
        return WeightFormat.DENSE
    if mode == "auto":
        return WeightFormat.STORED if quantized_file else WeightFormat.DENSE
    return WeightFormat(mode)


def describe_weights(model) -> str:
    """e.g. 'Q4_K x 150, Q4_K+Q6_K x 14, Q6_K x 1 (kvserve's quantized kernel); dense ': what the quantized path
    holds, by the file's types (int4 / int8: quantized at load)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            kind = "+".join(m.kinds) if m.bits else "dense"
            counts[kind] = counts.get(kind, 0) + 1
    return (
        ", ".join(f"{k} x {n}" for k, n in sorted(counts.items())) + " (kvserve's quantized kernel); dense "
    )


def bound_onednn_caches(capacity: int = 256) -> None:
    """Cap the kernels oneDNN keeps per GEMM shape. oneDNN reads these variables once, at its first use, so
    they are set here, before the model is built; a value already in the environment wins.

    Both of its caches (ideep's and the library's) default to 1,024 entries, and each entry holds memory
    (~0.25 MiB for small shapes): a server's RSS grew by 230 MiB over 800 mixed requests, by 50 MiB with
    both at 256. Steady decoding uses a few dozen shapes (GEMM rows are bucketed), so nothing is rebuilt.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but no CUDA GPU is available to torch")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu or cuda")
    return torch.device(name)


def select_dtype(name: str, device: torch.device, tier: CpuTier | None) -> torch.dtype:
    """--dtype, else bfloat16 on GPUs and the CPU tier's own numbers on CPU (bfloat16 only where the CPU
    multiplies it natively: elsewhere every bfloat16 operation is a conversion around float32 arithmetic)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    return tier.dtype if tier is not None else torch.bfloat16


def select_kv_cache_dtype(name: str, dtype: torch.dtype, tier: CpuTier | None) -> torch.dtype:
    """--kv-cache-dtype, else the CPU tier's (bfloat16 under float32 or bfloat16 activations) or, on GPUs and
    under float16, the model's dtype. The cache holds the model's dtype or bfloat16 under float32."""
    if name == "auto":
        return tier.kv_dtype if tier is not None and dtype in (torch.float32, torch.bfloat16) else dtype
    if name not in DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}: use auto, {', '.join(DTYPES)}")
    kv_dtype = DTYPES[name]
    if kv_dtype != dtype and not (kv_dtype == torch.bfloat16 and dtype == torch.float32):
        raise ValueError(
            f"--kv-cache-dtype {name} with {str(dtype).removeprefix('torch.')} activations: the cache holds the "
            "activations' dtype, or bfloat16 under float32"
        )
    return kv_dtype


def select_cpu_kernels(mode: str, device: torch.device, tier: CpuTier | None):
    """The C++ CPU kernels built for the tier (model/kernels.py) when they are wanted, else None (PyTorch ops).
    Missing or stale ones are an error naming the install command; ones whose build failed at install are
    skipped with a warning unless asked for (`on`)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"unknown --cpu-kernels {mode!r}: use auto, on or off")
    if device.type != "cpu" or mode == "off":
        return None
    module = kernels.load(tier.name)
    if module is None and mode == "on":
        raise RuntimeError("--cpu-kernels on: the C++ kernels could not be built at install (see the log)")
    return module


def select_gemm_activations(mode: str, cpu_kernels, dtype: torch.dtype) -> bool:
    """Whether the quantized GEMMs round their activations to int8 per group of 32, as llama.cpp does on the same
    files: `auto` where the tier's kernels round this dtype's (kernels.gemm_int8: AVX512-VNNI with BF16 bfloat16
    ones, AVX2 any), `int8` the same with a warning where they cannot; `wide` keeps the tier's wider activations
    (bfloat16, or int16 per 32), closer to float32 at ~0.7x the GEMMs' rate at many rows (README, CPU tiers)."""
    if mode not in ("auto", "int8", "wide"):
        raise ValueError(f"unknown --gemm-activations {mode!r}: use auto, int8 or wide")
    if mode == "wide":
        return False
    can = cpu_kernels is not None and str(dtype).removeprefix("torch.") in cpu_kernels.gemm_int8
    if mode == "int8" and not can:
        log.warning(
            "--gemm-activations int8: this tier's kernels round no %s activations (AVX512-VNNI with BF16 does "
            "bfloat16 ones, AVX2 alone any); the quantized GEMMs take the tier's own",
            str(dtype).removeprefix("torch."),
        )
    return can


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
    model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, device, max_drafts: int = 0
) -> CacheLayout:
    """What the budget holds. A hybrid's running states take at most 40% of it (fewer sequences than
    --max-num-seqs where they would take more: a 35B-A3B's state is 61 MiB a sequence), its snapshots at most a
    quarter, four per running sequence at most (a prompt's, a reply's, a shared prefix's), and the states of a
    step's drafts (max_drafts, where it drafts) at most a tenth; K/V the rest."""
    per_block = KVCache.bytes_per_block(model_config, config.block_size, dtype)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":  # after loading: what the weights left, minus 1 GiB for activations
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - (1 << 30)
    else:
        budget = CPU_KV_CACHE_BYTES
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
    state_bytes = (num_state_slots + num_snapshots + num_draft_slots) * per_state
    num_blocks = (budget - state_bytes) // per_block
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes"
            + (f" after {state_bytes} bytes of DeltaNet state" if state_bytes else "")
        )
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB, %s), a block %d layers' K/V; %s",
        num_blocks,
        config.block_size,
        num_blocks * per_block / 2**30,
        str(dtype).removeprefix("torch."),
        model_config.kv_page_layers,
        describe_kv_groups(model_config),
    )
    return CacheLayout(num_blocks, num_state_slots, num_snapshots, num_draft_slots)


def describe_kv_groups(model_config: ModelConfig) -> str:
    """What each kind of attention layer keeps, for the start log: "3 full-attention layers in 1 group, 15
    sliding-window (512) layers in 5 groups (blocks behind the window freed)"."""
    kinds: dict[int | None, list] = {}
    for group in model_config.kv_groups:
        kinds.setdefault(group.window, []).append(group)
    return ", ".join(
        f"{sum(len(g.layers) for g in groups)} "
        + ("full-attention" if window is None else f"sliding-window ({window})")
        + f" layers in {len(groups)} group{'s' if len(groups) > 1 else ''}"
        + ("" if window is None else " (blocks behind the window freed)")
        for window, groups in kinds.items()
    )


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
