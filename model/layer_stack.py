"""A step's decoder layers in one C++ call (model/csrc/layer_stack.cpp), for Llama-style blocks (`covers`: Llama,
Mistral, Qwen2 and 3, Gemma 2, 3 and 4, Phi-3; the MoE families' sparse FFNs and GPT-OSS's sinks and clamped
SwiGLU too; the hybrids' Gated DeltaNet layers and Qwen3.5's gated attention with partial rotary) whose GEMMs all
run on quantized weights with kvserve's CPU kernels: the default model's path, and every GGUF file's of those families.

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

    def __call__(self, x, ropes: dict, kv_cache, meta: list, states=None, per_layer=None, prompt_runs=None):
        """ropes: the step's (cos, sin) tables of each Rope (model/transformer.py's Transformer.rope); meta: the
        step's attention metadata, one per KV group; states: a hybrid's StepStates (model/deltanet.py);
        per_layer: Gemma 4's [T, layers, size] per-layer inputs; prompt_runs: [R, 2] int64 runs of prompt rows,
        whose GEMMs run on the weights dequantized to bfloat16 (the amx tier's quant_gemm_rows) and whose attention
        runs on bfloat16 tiles. Returns (the last block's output, the stream it adds to, or None where the block
        returned the stream whole)."""
        tables = [ropes[rope] for rope in self.ropes]
        pools = (kv_cache.conv, kv_cache.recurrent, states.table) if self.hybrid else (None, None, None)
        return self.stack.forward(
            x, kv_cache.k, kv_cache.v, [m.slot_mapping for m in meta], [m.block_tables for m in meta],
            meta[0].seqs, meta[0].block_size, KERNEL_CHUNK, [cos for cos, _ in tables], [sin for _, sin in tables],
            *pools, per_layer, prompt_runs,
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
    # Gemma 4's value norm, layer scalars and per-layer inputs (each step's, gated into the stream after each block)
    "v_norm": _any, "layer_scalar": _any, "per_layer_input_size": _any,
    "per_layer_vocab_size": _any,  # the per-layer embeddings are looked up before the blocks
}  # fmt: skip
LAYER_FIELDS = {  # (layer, config) -> whether the loop computes it
    "window": _any,
    # RoPE over the whole head or its first dims (Qwen3.5's partial rotary); a DeltaNet layer has none
    "rope": lambda spec, c: (
        spec.mixer == "linear_attention" or (spec.rope is not None and spec.rope.dim <= c.kv_shape(spec)[1])
    ),
    # moe: the C++ MoE FFN (model/csrc/moe.cpp); dense_and_moe: both, side by side (Gemma 4 26B-A4B)
    "ffn": lambda spec, c: spec.ffn in ("dense", "moe", "dense_and_moe"),
    # attention, or Gated DeltaNet (model/csrc/deltanet.cpp)
    "mixer": lambda spec, c: spec.mixer in ("attention", "linear_attention"),
    # each layer's own heads (its view of the cache's rows: KVCache.layer), keys as values, K/V read from an earlier
    # layer (its queries rotated in the loop), its own FFN size (its GEMMs')
    "head_dim": _any,
    "num_kv_heads": _any,
    "k_eq_v": _any,
    "kv_source": _any,
    "intermediate_size": _any,
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
    for i, block in enumerate(model.layers):
        fields = layer_fields(block, i, config, ropes, kernels)
        if fields is None:
            return None
        layers.append(kernels.Layer(**fields))
    return LayerStack(
        kernels.LayerStack(
            layers=layers, num_heads=config.num_heads, eps=config.norm_eps, softcap=config.attn_softcap or 0.0,
            gelu=config.mlp == "geglu",
            **(dict(swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
               if config.mlp == "clamped_swiglu" else {}),
        ),
        ropes,
        bool(config.linear_layers),
    )  # fmt: skip


def layer_fields(block, i: int, config, ropes: list, kernels) -> dict | None:
    """Block i's weights and shape as kernels.Layer's keywords, or None where some GEMM of it is not quantized."""
    attn, mlp, spec = block.attn, block.mlp, config.layers[i]
    mixer = [attn.in_proj, attn.out] if block.linear else [attn.qkv, attn.o]
    dense = mlp.dense if spec.ffn == "dense_and_moe" else mlp if spec.ffn == "dense" else None
    moe = mlp.moe if spec.ffn == "dense_and_moe" else mlp if spec.ffn == "moe" else None
    gemms = [*mixer, *([dense.up, dense.down] if dense else [])]
    if block.per_layer_gate is not None:
        gemms += [block.per_layer_gate, block.per_layer_projection]
    if any(getattr(linear, "bits", None) is None for linear in gemms) or (moe and moe.fused is None):
        return None  # some weight left dense, or some expert
    fields = dict(
        norm1=block.norm1.weight, norm2=block.norm2.weight, qkv=None, o=None, deltanet=None,
        post_attn_norm=weight_of(block.post_attn_norm), post_mlp_norm=weight_of(block.post_mlp_norm),
        moe=moe.fused if moe else None, layer_scalar=block.layer_scalar,
    )  # fmt: skip
    if dense:
        fields |= dict(up=dense.up.gemm, down=dense.down.gemm)
    if spec.ffn == "dense_and_moe":
        fields |= dict(
            dense_norm=mlp.dense_norm.weight, moe_in_norm=mlp.moe_in_norm.weight, moe_norm=mlp.moe_norm.weight
        )
    if block.per_layer_gate is not None:
        fields |= dict(
            per_layer_gate=block.per_layer_gate.gemm, per_layer_projection=block.per_layer_projection.gemm,
            per_layer_norm=block.per_layer_norm.weight,
        )  # fmt: skip
    if block.linear:
        if attn.kernel is None:
            return None  # its recurrence asked of PyTorch ops
        return fields | dict(deltanet=deltanet_mixer(attn, config, i, kernels))
    group, row, part = config.kv_places[i]
    return fields | dict(
        qkv=attn.qkv.gemm, o=attn.o.gemm, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
        k_eq_v=attn.k_eq_v, v_norm=attn.v_norm, reads_kv=attn.reads_kv, window=spec.window or 0,
        q_norm=weight_of(getattr(attn, "q_norm", None)), k_norm=weight_of(getattr(attn, "k_norm", None)),
        output_gate=config.attn_output_gate, sinks=attn.sinks, kv_group=group, kv_index=row, kv_part=part,
        rope=ropes.index(spec.rope), rotary_dim=spec.rope.dim,
    )  # fmt: skip


def weight_of(norm):
    """A norm's weight, or None where the block has no such norm."""
    return norm.weight if norm is not None else None


def deltanet_mixer(deltanet, config, layer: int, kernels):
    """Layer `layer`'s Gated DeltaNet for the C++ loop: the tensors model/deltanet.py's mix passes, and its row of
    the cache's state pools."""
    spec = config.linear_attention
    return kernels.DeltaNetMixer(
        deltanet.in_proj.gemm, deltanet.out.gemm, deltanet.conv.view(spec.conv_dim, spec.conv_kernel),
        deltanet.A_log, deltanet.dt_bias, deltanet.gated_norm, spec.num_key_heads, spec.key_head_dim,
        spec.value_head_dim, spec.tiled_value_heads, config.linear_layers.index(layer),
    )  # fmt: skip
