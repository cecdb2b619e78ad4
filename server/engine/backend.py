"""Where a run's ops execute, decided once at start: the CPU (kvserve's C++ kernels for its tier, or PyTorch ops)
or a CUDA GPU (PyTorch ops).

select_backend() makes every choice that depends on the device and returns one object that supplies them: the
model's ops (each GEMM's weight format, the norms and activations, the layer loop), the weights' format, the
attention backend, the sampler's kernels, the KV cache's dtype and budget, whether a step's tokens are
batch-invariant, and what to do with the weights once loaded. server/engine/setup.py asks it once; nothing else
in the engine branches on the device, and the CUDA-specific code is CudaBackend.
"""

import enum
import gc
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
from model.linear import Linear, OneDnnLinear, PlainLinear
from model.loader import model_name, stores_quantized
from model.quant import QuantizedLinear
from model.sampling import TORCH_SAMPLER, SamplerKernels
from model.transformer import Ops
from server.engine.config import EngineConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# default cache on CPU: 2 GiB, zeroed (so resident) at start: a machine short of memory fails then, not under load
CPU_KV_CACHE_BYTES = 2 << 30
# on a GPU without --kv-cache-memory: what --gpu-memory-utilization leaves after the weights, less this for a
# step's activations
GPU_ACTIVATION_BYTES = 1 << 30
# the Triton attention kernel's largest error against the PyTorch path at start, relative to the outputs' largest
# value: float32's and 16-bit's rounding over a few dozen keys, with room; a miscompiled kernel is off by ~1
TRITON_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}


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


def select_backend(config: EngineConfig, model) -> "CpuBackend | CudaBackend":
    """The backend of `config.device` for `model` (a Hugging Face folder's path, or a source: model/loader.py),
    each choice logged with why."""
    device = select_device(config.device)
    if device.type == "cuda":
        return CudaBackend.create(config, model, device)
    return CpuBackend.create(config, model)


@dataclass
class CpuBackend:
    """The CPU: kvserve's C++ kernels built for the CPU's tier (model/kernels.py), or PyTorch ops without them."""

    tier: CpuTier
    kernels: object | None  # the tier's C++ kernels; None: PyTorch ops
    dtype: torch.dtype
    weights: WeightFormat
    ops: Ops
    pad_gemms: bool  # the dense GEMMs pad small batches so that a row's bits never depend on its batch
    onednn: bool  # the dense GEMMs' weights packed for oneDNN (else F.linear)
    activations_log: str  # what the quantized GEMMs' activations are, for the start log
    device = torch.device("cpu")
    # async scheduling's default (engine.py): off, since the host's work between steps and the steps themselves
    # would run on the same cores, and each output would come a step later
    async_scheduling = False

    @classmethod
    def create(cls, config: EngineConfig, model) -> "CpuBackend":
        bound_onednn_caches()  # before the model is built: oneDNN reads them at its first use
        tier = select_cpu_tier(config.cpu_tier, config.cpu_kernels)
        cpu_kernels = select_cpu_kernels(config.cpu_kernels, tier)
        dtype = select_dtype(config.dtype, tier)
        why_not = None
        if cpu_kernels is None:
            why_not = "the C++ CPU kernels are off or could not be built"
        elif dtype not in (torch.float32, torch.bfloat16):
            why_not = f"the quantized GEMMs take float32 or bfloat16 activations, not {dtype_name(dtype)}"
        weights = select_quantization(config.quantization, model, why_not)
        # A request's tokens must not depend on its batch. CPU GEMMs may switch kernels (summation orders) for
        # small row counts: the GEMMs that do pad small batches (measured per weight shape at load). By default
        # for 16-bit dtypes (the avx512bf16 tier), where it is nearly free, not for float32, where more GEMMs
        # pad. The quantized GEMMs are batch-invariant as they are.
        pad = config.batch_invariant if config.batch_invariant is not None else dtype != torch.float32
        onednn = OneDnnLinear.available(dtype, cls.device)
        linear = (OneDnnLinear if onednn else PlainLinear)(batch_invariant=pad)
        activations_log = ""
        if weights is not WeightFormat.DENSE:
            int8 = select_gemm_activations(config.gemm_activations, cpu_kernels, dtype)
            linear = QuantizedLinear(cpu_kernels, linear, weights.quantize_to, int8_activations=int8)
            rounded = "rounded to int8 per 32" if int8 else "the tier's own"
            activations_log = f"the quantized ones' activations {rounded}; "
        ops = Ops.with_kernels(linear, cpu_kernels)
        return cls(tier, cpu_kernels, dtype, weights, ops, pad, onednn, activations_log)

    def log_gemms(self, model: torch.nn.Module) -> None:
        """What the loaded model's GEMMs run as, for the start log."""
        log.info(
            "GEMMs: %s%s%s%s; attention and RMSNorm: %s",
            self.activations_log,
            describe_weights(model) if self.weights is not WeightFormat.DENSE else "",
            "weights packed for oneDNN" if self.onednn else "F.linear",
            ", small batches padded for batch invariance" if self.pad_gemms else "",
            "kvserve's C++ CPU kernels" if self.kernels else "PyTorch ops",
        )

    def batch_invariant(self, model: torch.nn.Module) -> bool:
        """Whether every step op of the loaded model is batch-invariant: the GEMMs padded or all quantized (the
        kernel is invariant as it is), attention by the kernel or padded."""
        gemms_invariant = self.pad_gemms or all(
            getattr(m, "bits", None) for m in model.modules() if isinstance(m, Linear)
        )
        return gemms_invariant and (self.kernels is not None or self.pad_gemms)

    def prompt_gemms(self, model: torch.nn.Module, config: EngineConfig) -> bool:
        """--prefill-gemms: auto runs a prompt's tokens' GEMMs on the weights dequantized to bfloat16, on AMX's
        tiles (kernels.gemm_dequantized: the amx tier), and their attention on bfloat16 tiles, where the layer stack runs the blocks (the one path that
        splits a step's rows by what they are), unless --dtype float32 was asked for (a prompt's activations are
        rounded to bfloat16 there); exact keeps decoding's kernels. Logged with why."""
        if config.prefill_gemms not in ("auto", "exact"):
            raise ValueError(f"unknown --prefill-gemms {config.prefill_gemms!r}: use auto or exact")
        why_not = None
        if config.prefill_gemms == "exact":
            why_not = "--prefill-gemms exact"
        elif self.kernels is None or not self.kernels.gemm_dequantized:
            why_not = f"the {self.tier.name} tier has no AMX bfloat16 tiles"
        elif getattr(model, "layer_stack", None) is None:
            why_not = "the blocks do not run as the C++ layer stack (dense or partly quantized weights)"
        elif config.dtype == "float32":
            why_not = "--dtype float32"
        if why_not is not None:
            log.info("prefill GEMMs: the exact kernels, as decoding's (%s)", why_not)
            return False
        log.info(
            "prefill GEMMs: a prompt's tokens on the weights dequantized to bfloat16, on AMX's tiles, and their "
            "attention on bfloat16 tiles; generated ones on the exact kernels (--prefill-gemms exact: those for all)"
        )
        return True

    def kv_cache_dtype(self, name: str) -> torch.dtype:
        return select_kv_cache_dtype(name, self.dtype, self.tier)

    def kv_cache_budget(self, config: EngineConfig) -> int:
        return config.kv_cache_memory if config.kv_cache_memory is not None else CPU_KV_CACHE_BYTES

    def attention(self, model_config: ModelConfig, block_size: int, num_blocks: int):
        if self.kernels is not None:  # batch-invariant as it is
            return CpuKernelAttention(self.kernels, block_size)
        mc = model_config
        shapes = {(g.num_kv_heads, g.head_dim) for g in mc.kv_groups} or {(mc.num_kv_heads, mc.head_dim)}
        min_query_len = (
            max(
                min_query_len_for_invariance(mc.num_heads, *shape, self.dtype, self.device)
                for shape in shapes
            )
            if self.pad_gemms
            else 1
        )
        log.info("attention pads queries to %d", min_query_len)
        kv_heads = mc.num_kv_heads if mc.uniform_kv else None
        return TorchAttention(
            block_size, kv_heads, num_blocks, self.device, mc.kv_group_windows, min_query_len
        )

    @property
    def sampler(self) -> SamplerKernels:
        """The sampler's noise and argmax: the kernels' bits are PyTorch's."""
        if self.kernels is None:
            return TORCH_SAMPLER
        return SamplerKernels(self.kernels.uniform_noise, self.kernels.argmax_rows)

    def ready(self, model: torch.nn.Module) -> None:
        """The weights every step streams, onto 2 MiB pages (model/huge_pages.py), before the first step. The
        quantized weights are packed onto them already (model/csrc/quant_pack.cpp, an MoE layer's experts too):
        what is left to copy is the rest (dense weights, scales, a packed weight's last partial frame), 0.1-0.7 s
        of the start for the default model, Qwen3.5 ~1.5B and the GPT-OSS, OLMoE and Qwen3.6 cuts (Zen 4). It
        used to run on a thread of its own, a frame at each of the engine's quiet moments, when the experts were
        still to copy (2.2 GB of the Qwen3.6 cut, ~5 s of a core): beside the first minute's requests it still
        took a core's share, and that cut's c1 ran at 67-74 tok/s against 76-81 once it was done (forced AVX2)."""
        start = time.monotonic()
        moved = on_huge_pages([*model.parameters(), *model.buffers()])
        log.info("%.2f GiB of weights on 2 MiB pages (%.1f s)", moved / 2**30, time.monotonic() - start)

    def synchronize(self) -> None:  # a CPU op has finished when it returns
        pass

    def spare_state_slots(self, model_config, config: EngineConfig) -> int:
        return 0  # no graphs, no padded rows

    def decode_graphs(self, model, kv_cache, attention, config: EngineConfig) -> None:
        return None  # graphs are CUDA's; a CPU step's ops are few and its kernels long (the fused layer loop)


@dataclass
class CudaBackend:
    """A CUDA GPU: PyTorch ops, the norms and SwiGLU by kvserve's Triton kernels (model/fused_triton.py); the weights
    dense in the model's dtype (bfloat16 by default), or, a quantized checkpoint's (GGUF), kept quantized and
    multiplied by kvserve's Triton GEMM (model/linear_triton.py); attention by the Triton kernel, RoPE and the K/V
    writes one kernel before it (torch's fused SDPA where it cannot run); decode steps replayed from CUDA graphs.
    Its steps are not batch-invariant (kvserve does not make cuBLAS's GEMMs so), so drafting stays off under
    `auto`."""

    device: torch.device
    dtype: torch.dtype
    ops: Ops
    weights: WeightFormat = WeightFormat.DENSE
    sampler = TORCH_SAMPLER
    async_scheduling = True  # the host's work between steps runs while the GPU computes the next (engine.py)

    @classmethod
    def create(cls, config: EngineConfig, model, device: torch.device) -> "CudaBackend":
        """Decides without touching the device: the dtype, and how the weights run (a quantized checkpoint kept
        quantized where Triton is here; --quantization int8 / int4 quantize dense ones at load alike)."""
        dtype = select_dtype(config.dtype, None)
        weights = select_quantization(config.quantization, model, triton_missing())
        linear = PlainLinear()
        if weights is not WeightFormat.DENSE:
            from model.linear_triton import TritonQuantLinear

            linear = TritonQuantLinear(device, dtype, linear, weights.quantize_to)
        grouped_experts = rms_norm = silu_mul = deltanet_decodes = None
        # where Triton is here: a sparse layer's dense experts as two grouped GEMMs (checked at load), the norms,
        # SwiGLU and a DeltaNet layer's step of decodes one kernel each
        if triton_missing() is None:
            from model.deltanet_triton import deltanet_decodes
            from model.fused_triton import rms_norm, silu_mul
            from model.moe_triton import grouped_experts
        # a DeltaNet layer's step of decodes as one (model/deltanet.py's _decodes), not a loop over sequences
        ops = Ops(linear, rms_norm, silu_mul, parallel_deltanet=True, grouped_experts=grouped_experts,
                  deltanet_decodes=deltanet_decodes)  # fmt: skip
        return cls(device, dtype, ops, weights)

    def log_gemms(self, model: torch.nn.Module) -> None:
        quantized = (
            describe_weights(model, "kvserve's Triton GEMM") if self.weights is not WeightFormat.DENSE else ""
        )
        fused = "kvserve's Triton kernels" if self.ops.rms_norm is not None else "PyTorch ops"
        log.info("GEMMs: %sF.linear; norms and SwiGLU: %s", quantized, fused)

    def batch_invariant(self, model: torch.nn.Module) -> bool:
        return False  # cuBLAS picks kernels by shape; kvserve does not pin them

    def prompt_gemms(self, model: torch.nn.Module, config: EngineConfig) -> bool:
        return False  # a CPU tier's (AMX's tiles)

    def kv_cache_dtype(self, name: str) -> torch.dtype:
        return select_kv_cache_dtype(name, self.dtype, None)

    def kv_cache_budget(self, config: EngineConfig) -> int:
        """--kv-cache-memory, else what --gpu-memory-utilization of the GPU leaves after what is in use now (the
        weights, and any other process's or engine's memory), less a step's activations. Memory torch holds in
        its cache but no tensor uses is given back first: mem_get_info counts it as used."""
        if config.kv_cache_memory is not None:
            return config.kv_cache_memory
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * config.gpu_memory_utilization) - (total - free) - GPU_ACTIVATION_BYTES

    def attention(self, model_config: ModelConfig, block_size: int, num_blocks: int):
        """kvserve's Triton kernel (model/attention_triton.py: K/V read in place through the block tables) where
        Triton loads and the kernel, built here for this model's heads, computes what the PyTorch path does;
        else torch's fused SDPA over K/V gathered out of the cache in every layer. Logged with why."""
        mc = model_config
        try:
            from model.attention_triton import TritonAttention, error_against_pytorch

            error = error_against_pytorch(mc, block_size, self.dtype, self.device)
            why_not = None if error <= TRITON_TOLERANCE[self.dtype] else f"is off by {error:.2g} here"
        except Exception as e:  # no Triton, or a kernel this device's compiler refuses: served all the same
            why_not = f"could not run: {type(e).__name__}: {e}"
        if why_not is None:
            log.info("attention: kvserve's Triton kernel, K/V read in place through the block tables")
            return TritonAttention.for_model(mc, block_size, self.device)
        log.warning(
            "attention: torch's SDPA over K/V gathered by block table (the Triton kernel %s)", why_not
        )
        kv_heads = mc.num_kv_heads if mc.uniform_kv else None
        return TorchAttention(block_size, kv_heads, num_blocks, self.device, mc.kv_group_windows, sdpa=True)

    def ready(self, model: torch.nn.Module) -> None:
        pass

    def synchronize(self) -> None:
        """Waits for the work queued on the GPU (a timer's edges)."""
        torch.cuda.synchronize(self.device)

    def spare_state_slots(self, model_config, config: EngineConfig) -> int:
        """A hybrid's DeltaNet state slot that no request holds, where decode steps may be graphed: the padded
        rows' state goes there."""
        return 1 if model_config.linear_layers and not config.enforce_eager else 0

    def decode_graphs(self, model, kv_cache, attention, config: EngineConfig):
        """Decode steps replayed from CUDA graphs (server/engine/decode_graphs.py), captured here, unless
        --enforce-eager, the model's steps cannot be recorded, or the capture fails (each logged with why)."""
        from server.engine.decode_graphs import DecodeGraphs, why_not_graphed

        why_not = "--enforce-eager" if config.enforce_eager else why_not_graphed(model, attention)
        if why_not is None and kv_cache.num_blocks < 2:
            why_not = "the KV cache has no block to spare for padded rows"
        if why_not is None and model.config.linear_layers and kv_cache.spare_state_slot is None:
            why_not = "the cache has no DeltaNet state slot to spare for padded rows"
        if why_not is not None:
            log.info("decode steps: eager (%s)", why_not)
            return None
        mc = model.config
        longest = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
        max_blocks = min(-(-longest // config.block_size), kv_cache.num_blocks)
        graphs = DecodeGraphs(model, kv_cache, attention, config.max_num_seqs, max_blocks)
        try:
            graphs.capture()
        except Exception as e:  # served all the same, eagerly
            log.warning("decode steps: eager (the CUDA graphs' capture failed: %s: %s)", type(e).__name__, e)
            return None
        return graphs


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but no CUDA GPU is available to torch")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu or cuda")
    return torch.device(name)


def select_cpu_tier(name: str, kernels_mode: str) -> CpuTier:
    """The CPU tier to run as (model/cpu_tier.py), logged with why. `auto` on a CPU better than the one the
    install built for (an image built elsewhere) takes the best tier it built, and says so."""
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


def select_cpu_kernels(mode: str, tier: CpuTier):
    """The C++ CPU kernels built for the tier (model/kernels.py) when they are wanted, else None (PyTorch ops).
    Missing or stale ones are an error naming the install command; ones whose build failed at install are
    skipped with a warning unless asked for (`on`)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"unknown --cpu-kernels {mode!r}: use auto, on or off")
    if mode == "off":
        return None
    module = kernels.load(tier.name)
    if module is None and mode == "on":
        raise RuntimeError("--cpu-kernels on: the C++ kernels could not be built at install (see the log)")
    return module


def select_dtype(name: str, tier: CpuTier | None) -> torch.dtype:
    """--dtype, else bfloat16 on GPUs (tier None) and the CPU tier's own numbers on CPU (bfloat16 only where the
    CPU multiplies it natively: elsewhere every bfloat16 operation is a conversion around float32 arithmetic)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    return tier.dtype if tier is not None else torch.bfloat16


def select_kv_cache_dtype(name: str, dtype: torch.dtype, tier: CpuTier | None) -> torch.dtype:
    """--kv-cache-dtype, else the CPU tier's (bfloat16 under float32 or bfloat16 activations) or, on GPUs (tier
    None) and under float16, the model's dtype. The cache holds the model's dtype or bfloat16 under float32."""
    if name == "auto":
        return tier.kv_dtype if tier is not None and dtype in (torch.float32, torch.bfloat16) else dtype
    if name not in DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}: use auto, {', '.join(DTYPES)}")
    kv_dtype = DTYPES[name]
    if kv_dtype != dtype and not (kv_dtype == torch.bfloat16 and dtype == torch.float32):
        raise ValueError(
            f"--kv-cache-dtype {name} with {dtype_name(dtype)} activations: the cache holds the activations' "
            "dtype, or bfloat16 under float32"
        )
    return kv_dtype


def select_quantization(mode: str, model, why_not: str | None) -> WeightFormat:
    """How the weights run, from --quantization (auto: a checkpoint's quantized weights as stored, where the
    quantized GEMMs can run, else dense). why_not: why the backend cannot run quantized GEMMs (None: it can)."""
    if mode not in ("auto", "none", "int8", "int4"):
        raise ValueError(f"unknown --quantization {mode!r}: use auto, none, int8 or int4")
    if mode == "none":
        return WeightFormat.DENSE
    if why_not and mode != "auto":
        raise ValueError(f"--quantization {mode}: {why_not}")
    quantized_file = stores_quantized(model)
    if why_not:
        if quantized_file:
            log.warning("serving the quantized weights of %s dequantized: %s", model_name(model), why_not)
        return WeightFormat.DENSE
    if mode == "auto":
        return WeightFormat.STORED if quantized_file else WeightFormat.DENSE
    return WeightFormat(mode)


def triton_missing() -> str | None:
    """Why the GPU cannot keep quantized weights so (None: it can): its GEMM is a Triton kernel."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton (the GPU's quantized GEMM) is not installed"
    return None


def select_gemm_activations(mode: str, cpu_kernels, dtype: torch.dtype) -> bool:
    """Whether the quantized GEMMs round their activations to int8 per group of 32, as llama.cpp does on the same
    files: `auto` where the tier's kernels round this dtype's (kernels.gemm_int8: AVX512-VNNI with BF16 bfloat16
    ones, AVX2 any), `int8` the same with a warning where they cannot; `wide` keeps the tier's wider activations
    (bfloat16, or int16 per 32), closer to float32 at ~0.7x the GEMMs' rate at many rows (README, CPU tiers)."""
    if mode not in ("auto", "int8", "wide"):
        raise ValueError(f"unknown --gemm-activations {mode!r}: use auto, int8 or wide")
    if mode == "wide":
        return False
    can = cpu_kernels is not None and dtype_name(dtype) in cpu_kernels.gemm_int8
    if mode == "int8" and not can:
        log.warning(
            "--gemm-activations int8: this tier's kernels round no %s activations (AVX512-VNNI with BF16 does "
            "bfloat16 ones, AVX2 alone any); the quantized GEMMs take the tier's own",
            dtype_name(dtype),
        )
    return can


def describe_weights(model, kernel: str = "kvserve's quantized kernel") -> str:
    """e.g. 'Q4_K x 150, Q4_K+Q6_K x 14, Q6_K x 1 (kvserve's quantized kernel); dense ': what the quantized path
    holds, by the file's types (int4 / int8: quantized at load)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Linear):
            kind = "+".join(m.kinds) if m.bits else "dense"
            counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x {n}" for k, n in sorted(counts.items())) + f" ({kernel}); dense "


def bound_onednn_caches(capacity: int = 256) -> None:
    """Cap the kernels oneDNN keeps per GEMM shape. oneDNN reads these variables once, at its first use, so
    they are set here, before the model is built; a value already in the environment wins.

    Both of its caches (ideep's and the library's) default to 1,024 entries, and each entry holds memory
    (~0.25 MiB for small shapes): a server's RSS grew by 230 MiB over 800 mixed requests, by 50 MiB with
    both at 256. Steady decoding uses a few dozen shapes (GEMM rows are bucketed), so nothing is rebuilt.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
