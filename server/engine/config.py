"""EngineConfig: the knobs of batching and of the KV cache, built by the CLI."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """Drafts verified in the normal step (vLLM's --speculative-config, method "ngram"): the tokens that followed
    the latest earlier match of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
    ride along with its decode; the output stays what it would have been without them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per request per step, at most
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # a step's decodes plus their drafts, at most: drafts fill the rows a step's GEMMs still compute at about
    # the cost of one (they read each weight once), and a step with this many decodes drafts nothing
    max_step_rows: int = 8

    def __post_init__(self):
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r} is not supported (only 'ngram')")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.max_step_rows < 2:
            raise ValueError("max_step_rows must be at least 2 (a decode and a draft)")


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
    # schedule and launch each step before reading the previous one back (engine.py): None = on a GPU only
    async_scheduling: bool | None = None
    enforce_eager: bool = False  # on a GPU: no CUDA graphs for decode steps (server/engine/decode_graphs.py)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # auto: the CPU tier's (bfloat16), on GPUs the model's | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"
    # auto: keep a checkpoint's quantized weights (a GGUF's) quantized on CPU | none: dequantize them |
    # int8, int4: also quantize dense weights at load (weight-only, groups of 32)
    quantization: str = "auto"
    cpu_kernels: str = "auto"  # C++ kernels on CPU: auto (where they built at install) | on | off
    # the CPU tier to run as (model/cpu_tier.py): auto | amx | avx512bf16 | avx512 | avx2 | generic
    cpu_tier: str = "auto"
    # the quantized GEMMs' activations on CPU: auto (rounded to int8 per 32, as llama.cpp's, where the tier has the
    # kernel: AVX512-VNNI with BF16, AVX2) | int8 (the same, warning where it cannot) | wide (the tier's own:
    # bfloat16 with AVX512-BF16, int16 per 32 with AVX2 and AMX; closer to float32, slower at many rows)
    gemm_activations: str = "auto"
    # a prompt's tokens' GEMMs on CPU: auto (on AMX's tiles, the quantized weights dequantized to bfloat16 a step at a
    # time: ~2x the exact kernel's rate at hundreds of rows; where the tier has them and the blocks run as the C++
    # layer stack, unless --dtype float32 is asked for) | exact (the integer kernels that generated tokens run). Either way a token's bits depend on it alone.
    prefill_gemms: str = "auto"
    # None = no speculative decoding; "auto" (the CLI's default) = n-gram drafts with SpeculativeConfig's defaults
    # where the run's steps are batch-invariant (ModelRunner.batch_invariant), so the output cannot change
    speculative: SpeculativeConfig | str | None = None
    task: str = "auto"  # auto | generate | embed | score: what the model serves (server/engine/pooling.py)
    pooling: str | None = None  # last | mean | cls: an embedder's pooling; None = the model's
    # where unseeded requests' seeds come from (vLLM's --seed): None = the system's entropy; a number makes a fresh
    # server's unseeded requests draw the same, arriving in the same order
    seed: int | None = None
