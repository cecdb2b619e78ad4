"""A step's decoder layers in one C++ call (model/csrc/layer_stack.cpp), for Llama-style blocks (`covers`: Llama,
Mistral, Qwen2 and 3, Gemma 2 and 3, Phi-3; the MoE families' sparse FFNs and GPT-OSS's sinks and clamped SwiGLU
too; the hybrids' Gated DeltaNet layers and Qwen3.5's gated attention with partial rotary) whose GEMMs all run on
quantized weights with kvserve's CPU kernels: the default model's path, and every GGUF file's of those families.

The C++ loop calls the same kernels as model/transformer.py's blocks, in the same order, so a token's outputs
have the same bits either way (tests/model/test_layer_stack.py). It exists for the lone decode step, where the
kernels take ~5 ms and the Python around their ~270 calls (module calls, argument conversion, views) took
~0.9 ms more (docs/performance-history.md); Gemma 3 270M's 18 blocks, with twice the norms, ~3 ms of a ~17 ms step.
A 512-token prefill step (~0.4 s) barely notices either way.
"""

from model.attention_cpu import KERNEL_CHUNK


class LayerStack:
    """The model's blocks as one call: (x, rope tables, kv_cache, meta) -> (last block's output, residual
    stream). meta must be the CPU kernel's metadata (model/attention_cpu.py), as it is wherever the kernels run."""

    def __init__(self, stack, ropes: list, hybrid: bool = False):
        self.stack = stack  # the compiled LayerStack, holding every layer's packed weights and norms
        self.ropes = ropes  # the distinct Ropes, in the order of the layers' indices into them
        self.hybrid = hybrid  # some layers are Gated DeltaNet's: the cache's state pools go with each step

    def __call__(self, x, ropes: dict, kv_cache, meta: list, states=None):
        """ropes: the step's (cos, sin) tables of each Rope (model/transformer.py's Transformer.rope); meta: the
        step's attention metadata, one per KV group; states: a hybrid's StepStates (model/deltanet.py)."""
        tables = [ropes[rope] for rope in self.ropes]
        pools = (kv_cache.conv, kv_cache.recurrent, states.table) if self.hybrid else (None, None, None)
        return self.stack.forward(
            x, kv_cache.k, kv_cache.v, [m.slot_mapping for m in meta], [m.block_tables for m in meta],
            meta[0].seqs, meta[0].block_size, KERNEL_CHUNK, [cos for cos, _ in tables], [sin for _, sin in tables],
            *pools,
        )  # fmt: skip


def _any(*_) -> bool:
    return True


# What the C++ loop computes, field by field, closed: every field of ModelConfig and of LayerSpec is here, with the
# values the loop computes exactly (it passes the sizes, eps, scales, windows and rope tables on, applies RMSNorm
# before each branch, and after it too in Gemma's sandwich, q/k norms per head or none, SwiGLU or GeGLU, an
# attention soft-cap) or _any where the field does not touch the blocks (embedding, head, tokens' ids; biases
# live in the GEMMs, norm offsets in the norms' weights). A field added to either dataclass fails
# tests/model/test_layer_stack.py until it is placed here: a new field can never slip past as "covered".
CONFIG_FIELDS = {
    "architecture": _any, "vocab_size": _any, "hidden_size": _any, "num_layers": _any, "num_heads": _any,
    "num_kv_heads": _any, "head_dim": _any, "intermediate_size": _any, "max_position_embeddings": _any,
    "norm_eps": _any, "layers": _any,  # each layer by LAYER_FIELDS
    "norm": lambda c: c.norm == "rmsnorm",
    "mlp": lambda c: c.mlp in ("swiglu", "geglu", "clamped_swiglu"),
    "swiglu_alpha": _any, "swiglu_limit": _any,  # clamped_swiglu's: passed on
    "positions": _any,  # learned positions are added before the blocks (their layers have no rope: LAYER_FIELDS)
    "block": lambda c: c.block in ("pre", "sandwich"),
    "qk_norm": lambda c: c.qk_norm in ("", "head"),
    "qkv_bias": _any, "o_bias": _any, "mlp_bias": _any, "norm_offset": _any, "attention_scale": _any,
    "embedding_scale": _any,
    "residual_scale": lambda c: c.residual_scale == 1.0,
    "logits_scaling": _any, "attn_softcap": _any, "final_softcap": _any, "tie_word_embeddings": _any,
    "attn_sinks": _any,  # each layer's sinks go to its attention
    "bos_token_id": _any, "eos_token_ids": _any, "torch_dtype": _any,
    "has_lm_head": _any,  # the LM head runs after the stack
    "moe": _any,  # the experts of the layers whose ffn says "moe" (LAYER_FIELDS)
    "linear_attention": _any,  # the shape of the layers whose mixer says linear_attention (LAYER_FIELDS)
    "attn_output_gate": _any,  # Qwen3.5's gated attention: its output times sigmoid(gate)
    # Gemma 4's value norm, layer scalars and per-layer embeddings: not in the loop
    "v_norm": lambda c: not c.v_norm,
    "layer_scalar": lambda c: not c.layer_scalar,
    "per_layer_input_size": lambda c: c.per_layer_input_size == 0,
    "per_layer_vocab_size": _any,
}  # fmt: skip
LAYER_FIELDS = {  # (layer, config) -> whether the loop computes it
    "window": _any,
    # RoPE over the whole head or its first dims (Qwen3.5's partial rotary); a DeltaNet layer has none
    "rope": lambda spec, c: (
        spec.mixer == "linear_attention" or (spec.rope is not None and spec.rope.dim <= c.head_dim)
    ),
    "ffn": lambda spec, c: spec.ffn in ("dense", "moe"),  # moe: the C++ MoE FFN (model/csrc/moe.cpp)
    # attention, or Gated DeltaNet (model/csrc/deltanet.cpp)
    "mixer": lambda spec, c: spec.mixer in ("attention", "linear_attention"),
    # the model's heads on every layer (the loop reads the cache as one [layers, KVH, slots, D] pool)
    "head_dim": lambda spec, c: spec.head_dim in (0, c.head_dim),
    "num_kv_heads": lambda spec, c: spec.num_kv_heads in (0, c.num_kv_heads),
    "k_eq_v": lambda spec, c: not spec.k_eq_v,
    "kv_source": lambda spec, c: spec.kv_source < 0,
    "intermediate_size": lambda spec, c: spec.intermediate_size == 0,
}


def covers(config) -> bool:
    """Whether the C++ loop computes exactly this model's blocks (CONFIG_FIELDS, LAYER_FIELDS). Anything else runs
    as the Python loop, never as a C++ loop that skips a norm or a scale."""
    return all(check(config) for check in CONFIG_FIELDS.values()) and all(
        check(spec, config) for spec in config.layers for check in LAYER_FIELDS.values()
    )


def build_layer_stack(model, kernels) -> LayerStack | None:
    """The loaded model's blocks as one LayerStack, or None where the C++ loop does not cover them (`covers`,
    or any block weight left dense)."""
    config = model.config
    if not covers(config):
        return None
    ropes = list(dict.fromkeys(spec.rope for spec in config.layers if spec.rope is not None))
    layers = []
    kv_rows = config.kv_rows
    for i, (block, spec) in enumerate(zip(model.layers, config.layers, strict=True)):
        attn = block.attn
        linears = (attn.in_proj, attn.out) if block.linear else (attn.qkv, attn.o)
        if spec.ffn == "moe" and block.mlp.fused is None:
            return None  # some expert left dense
        dense_ffn = (block.mlp.up, block.mlp.down) if spec.ffn == "dense" else ()
        if any(getattr(linear, "bits", None) is None for linear in (*linears, *dense_ffn)):
            return None
        if block.linear:
            if attn.kernel is None:
                return None  # its recurrence asked of PyTorch ops
            mixer = (None, None, deltanet_mixer(attn, config, i, kernels))
        else:
            mixer = (attn.qkv.gemm, attn.o.gemm, None)
        qk = (attn.q_norm.weight, attn.k_norm.weight) if config.qk_norm and not block.linear else (None, None)
        post = (block.post_attn_norm, block.post_mlp_norm)
        ffn = (*(linear.gemm for linear in dense_ffn), None) if dense_ffn else (None, None, block.mlp.fused)
        rope = (ropes.index(spec.rope), spec.rope.dim) if spec.rope is not None else (-1, 0)
        kv_row = kv_rows.get(i, (-1, -1))
        layers.append(kernels.Layer(
            block.norm1.weight, *mixer, block.norm2.weight, *ffn, *qk,
            *(norm.weight if norm is not None else None for norm in post), spec.window or 0, *rope,
            config.attn_output_gate and not block.linear, getattr(attn, "sinks", None), *kv_row,
        ))  # fmt: skip
    attn = model.layers[config.attention_layers[0]].attn
    return LayerStack(
        kernels.LayerStack(
            layers, attn.num_heads, attn.num_kv_heads, attn.head_dim, config.norm_eps, attn.scale,
            config.attn_softcap or 0.0, config.mlp == "geglu",
            *((config.swiglu_alpha, config.swiglu_limit) if config.mlp == "clamped_swiglu" else (1.0, 0.0)),
        ),
        ropes,
        bool(config.linear_layers),
    )  # fmt: skip


def deltanet_mixer(deltanet, config, layer: int, kernels):
    """Layer `layer`'s Gated DeltaNet for the C++ loop: the tensors model/deltanet.py's mix passes, and its row of
    the cache's state pools."""
    spec = config.linear_attention
    return kernels.DeltaNetMixer(
        deltanet.in_proj.gemm, deltanet.out.gemm, deltanet.conv.view(spec.conv_dim, spec.conv_kernel),
        deltanet.A_log, deltanet.dt_bias, deltanet.gated_norm, spec.num_key_heads, spec.key_head_dim,
        spec.value_head_dim, spec.tiled_value_heads, config.linear_layers.index(layer),
    )  # fmt: skip
