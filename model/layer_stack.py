"""A step's decoder layers in one C++ call (model/csrc/layer_stack.cpp), for plain Llama blocks (`covers`) whose
GEMMs all run on quantized weights with kvserve's CPU kernels: the default model's path.

The C++ loop calls the same kernels as model/transformer.py's blocks, in the same order, so a token's outputs
have the same bits either way (tests/model/test_layer_stack.py). It exists for the lone decode step, where the
kernels take ~5 ms and the Python around their ~270 calls (module calls, argument conversion, views) took
~0.9 ms more (README, Benchmarks); a 512-token prefill step (~0.4 s) barely notices either way.
"""

from model.attention_cpu import KERNEL_CHUNK


class LayerStack:
    """The model's blocks as one call: (x, rope, kv_cache, meta) -> (last block's output, residual stream).
    meta must be the CPU kernel's metadata (model/attention_cpu.py), as it is wherever the kernels run."""

    def __init__(self, stack, window: int | None):
        self.stack = stack  # the compiled LayerStack, holding every layer's packed weights
        self.window = window or 0  # every layer's sliding window (0: none)

    def __call__(self, x, rope, kv_cache, meta):
        cos, sin = rope if rope is not None else (None, None)
        return self.stack.forward(
            x, kv_cache.k, kv_cache.v, meta.slot_mapping, meta.block_tables, meta.seqs, meta.block_size,
            self.window, KERNEL_CHUNK, cos, sin,
        )  # fmt: skip


def covers(config) -> bool:
    """Whether the C++ loop computes exactly this model's blocks: an allow-list of what it does (pre-norm
    RMSNorm, SwiGLU, no q/k norms, one window and one full-width RoPE for every layer, no scalars or caps).
    Anything else runs as the Python loop, never as a C++ loop that skips a norm or a scale."""
    spec = config.layers[0]
    return (
        config.norm == "rmsnorm"
        and config.mlp == "swiglu"
        and config.block == "pre"
        and not config.qk_norm
        and config.residual_scale == 1.0
        and config.attn_softcap is None
        and all(layer == spec for layer in config.layers)
        and spec.rope is not None
        and spec.rope.dim == config.head_dim
    )


def build_layer_stack(model, kernels) -> LayerStack | None:
    """The loaded model's blocks as one LayerStack, or None where the C++ loop does not cover them (`covers`,
    or any block weight left dense)."""
    config = model.config
    if not covers(config):
        return None
    layers = []
    for block in model.layers:
        linears = (block.attn.qkv, block.attn.o, block.mlp.up, block.mlp.down)
        if any(getattr(linear, "bits", None) is None for linear in linears):
            return None
        gemms = [linear.gemm for linear in linears]  # model/quant.py's QuantizedLinear.prepare
        layers.append(kernels.Layer(block.norm1.weight, *gemms[:2], block.norm2.weight, *gemms[2:]))
    attn = model.layers[0].attn
    return LayerStack(
        kernels.LayerStack(
            layers, attn.num_heads, attn.num_kv_heads, attn.head_dim, config.norm_eps, attn.scale
        ),
        config.layers[0].window,
    )
