"""EngineConfig: the knobs of batching and of the KV cache, built by the CLI."""

from dataclasses import dataclass


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # sequences in one step, at most
    max_num_batched_tokens: int = 512  # tokens (decodes + prefill chunks) in one step, at most
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = the device's default
    gpu_memory_utilization: float = 0.9  # share of GPU memory kvserve may use (when kv_cache_memory is None)
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None = the model's context, capped to what the cache holds
    batch_invariant: bool | None = None  # pad small GEMMs so a row's numbers never depend on its batch;
    # None = on for 16-bit dtypes on CPU (nearly free there), off for float32
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # auto: the CPU tier's (bfloat16), on GPUs the model's | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"
    # auto: keep a checkpoint's quantized weights (a GGUF's) quantized on CPU | none: dequantize them |
    # int8, int4: also quantize dense weights at load (weight-only, groups of 32)
    quantization: str = "auto"
    cpu_kernels: str = "auto"  # C++ kernels on CPU: auto (where they built at install) | on | off
    cpu_tier: str = (
        "auto"  # the CPU tier to run as (model/cpu_tier.py): auto | avx512bf16 | avx512 | avx2 | generic
    )
