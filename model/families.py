"""What each supported architecture is: one table, read by the config (model/config.py), the loader
(model/loader.py) and, through the config, the transformer and its fused C++ loop (model/layer_stack.py).

A family is a Llama block plus switches (../shared/MODELS.md lists what each family changes, with sources):
where the norms sit, q/k norms, the MLP's activation, biases, scalars, and which checkpoint tensor fills each
of kvserve's parameters, and for a Mixture-of-Experts family which layers are sparse and how its router
picks (`Moe`). Adding a family is an entry here; a block that differs in kind needs a module of its own behind
the same forward (model/moe.py is the sparse FFN's). The GGUF side (llama.cpp's names and layouts) is weights/gguf_arch.py's table:
weights/ imports nothing from model/, so it converts a GGUF into a folder this table reads.
"""

from dataclasses import dataclass, field

# kvserve parameter name -> (checkpoint tensor names, transform). Transforms: "cat" joins along dim 0 (fused
# q/k/v and gate/up), "t" transposes GPT-2's Conv1D weights, "expert" takes expert {e}'s slice of a tensor that
# stacks every expert's (Granite MoE's [experts, out, in]), "expert_t" transposes that slice (GPT-OSS's
# [experts, in, out]), "expert_pairs" / "expert_t_pairs" also put its interleaved gate/up rows (gate, up, gate,
# ...) as [gate; up] (GPT-OSS's gate_up_proj and its bias), "ungroup_qkvz_ba" regroups Qwen3-Next's two
# DeltaNet input projections as one (model/loader.py's ungroup_qkvz_ba), "" copies. `{i}` is the layer index, `{e}` the
# expert's. A parameter stored two ways has a list of such pairs, the first whose tensors the checkpoint holds
# taken (GPT-OSS's experts: Hugging Face's stacked tensors, or a GGUF's per expert).
Names = tuple[list[str], str]
WeightNames = dict[str, Names | list[Names]]


def _layer(name: str) -> str:
    return f"model.layers.{{i}}.{name}"


def llama_weights(**norms: str) -> WeightNames:
    """A Llama block's tensors; `norms` maps kvserve's norm names (norm1, norm2, post_attn_norm,
    post_mlp_norm, q_norm, k_norm) to the checkpoint's names inside a layer."""
    names = {
        "embed.weight": (["model.embed_tokens.weight"], ""),
        "norm.weight": (["model.norm.weight"], ""),
        "lm_head.weight": (["lm_head.weight"], ""),
        "layers.{i}.attn.qkv.weight": ([_layer(f"self_attn.{p}_proj.weight") for p in "qkv"], "cat"),
        "layers.{i}.attn.qkv.bias": ([_layer(f"self_attn.{p}_proj.bias") for p in "qkv"], "cat"),
        "layers.{i}.attn.o.weight": ([_layer("self_attn.o_proj.weight")], ""),
        "layers.{i}.attn.o.bias": ([_layer("self_attn.o_proj.bias")], ""),
        "layers.{i}.mlp.up.weight": ([_layer("mlp.gate_proj.weight"), _layer("mlp.up_proj.weight")], "cat"),
        "layers.{i}.mlp.up.bias": ([_layer("mlp.gate_proj.bias"), _layer("mlp.up_proj.bias")], "cat"),
        "layers.{i}.mlp.down.weight": ([_layer("mlp.down_proj.weight")], ""),
        "layers.{i}.mlp.down.bias": ([_layer("mlp.down_proj.bias")], ""),
    }
    for ours, theirs in norms.items():
        module = ours if ours in ("norm1", "norm2", "post_attn_norm", "post_mlp_norm") else f"attn.{ours}"
        names[f"layers.{{i}}.{module}.weight"] = ([_layer(f"{theirs}.weight")], "")
    return names


def moe_weights(
    names: WeightNames,
    moe: str = "mlp",
    router: str = "gate",
    expert: str = "experts.{e}",
    gate_up_down=("gate_proj", "up_proj", "down_proj"),
    shared: bool = False,
) -> WeightNames:
    """A Llama block's tensors with a sparse FFN in place of the MLP (dense layers, where a family has them, keep
    the MLP's names): the router, each expert's gate and up (fused, as the MLP's) and down, and a shared expert
    with its gate (Qwen2-MoE). `moe` names the FFN module, `router` and `expert` modules inside it."""
    gate, up, down = (_layer(f"{moe}.{expert}.{p}.weight") for p in gate_up_down)
    names = names | {
        "layers.{i}.mlp.router.weight": ([_layer(f"{moe}.{router}.weight")], ""),
        "layers.{i}.mlp.experts.{e}.up.weight": ([gate, up], "cat"),
        "layers.{i}.mlp.experts.{e}.down.weight": ([down], ""),
    }
    if shared:
        names = names | {
            "layers.{i}.mlp.shared.up.weight": ([_layer(f"{moe}.shared_expert.{p}.weight") for p in ("gate_proj", "up_proj")], "cat"),
            "layers.{i}.mlp.shared.down.weight": ([_layer(f"{moe}.shared_expert.down_proj.weight")], ""),
            "layers.{i}.mlp.shared_gate.weight": ([_layer(f"{moe}.shared_expert_gate.weight")], ""),
        }  # fmt: skip
    return names


LLAMA_NORMS = dict(norm1="input_layernorm", norm2="post_attention_layernorm")
QK_NORMS = dict(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
# Gemma's post_attention_layernorm normalizes the attention's output; its MLP has a norm before and after.
GEMMA_NORMS = dict(
    norm1="input_layernorm",
    post_attn_norm="post_attention_layernorm",
    norm2="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)

# Phi-3: q/k/v in one tensor, gate/up in one tensor, in the orders kvserve fuses them
PHI3_WEIGHTS = llama_weights(**LLAMA_NORMS) | {
    "layers.{i}.attn.qkv.weight": ([_layer("self_attn.qkv_proj.weight")], ""),
    "layers.{i}.mlp.up.weight": ([_layer("mlp.gate_up_proj.weight")], ""),
}

# Granite MoE: every expert's gate and up in one [experts, 2 x size, hidden] tensor, down in [experts, hidden, size]
GRANITE_MOE_WEIGHTS = llama_weights(**LLAMA_NORMS) | {
    "layers.{i}.mlp.router.weight": ([_layer("block_sparse_moe.router.layer.weight")], ""),
    "layers.{i}.mlp.experts.{e}.up.weight": ([_layer("block_sparse_moe.input_linear.weight")], "expert"),
    "layers.{i}.mlp.experts.{e}.down.weight": ([_layer("block_sparse_moe.output_linear.weight")], "expert"),
}


# GPT-OSS: q/k/v/o with biases, a sink logit per head; the router with a bias; every expert's interleaved gate/up
# in one [experts, hidden, 2 x size] tensor and down in [experts, size, hidden], each with a bias
# (a GGUF's experts read per expert, gate and up apart, as weights/gguf_arch.py's GPT_OSS_LAYER names them)
def _expert(kind: str) -> str:
    return _layer(f"mlp.experts.{{e}}.{kind}")


GPT_OSS_WEIGHTS = llama_weights(**LLAMA_NORMS) | {
    "layers.{i}.attn.sinks": ([_layer("self_attn.sinks")], ""),
    "layers.{i}.mlp.router.weight": ([_layer("mlp.router.weight")], ""),
    "layers.{i}.mlp.router.bias": ([_layer("mlp.router.bias")], ""),
    "layers.{i}.mlp.experts.{e}.up.weight": [
        ([_layer("mlp.experts.gate_up_proj")], "expert_t_pairs"),
        ([_expert("gate_proj.weight"), _expert("up_proj.weight")], "cat"),
    ],
    "layers.{i}.mlp.experts.{e}.up.bias": [
        ([_layer("mlp.experts.gate_up_proj_bias")], "expert_pairs"),
        ([_expert("gate_proj.bias"), _expert("up_proj.bias")], "cat"),
    ],
    "layers.{i}.mlp.experts.{e}.down.weight": [
        ([_layer("mlp.experts.down_proj")], "expert_t"),
        ([_expert("down_proj.weight")], ""),
    ],
    "layers.{i}.mlp.experts.{e}.down.bias": [
        ([_layer("mlp.experts.down_proj_bias")], "expert"),
        ([_expert("down_proj.bias")], ""),
    ],
}

# Qwen3.5: gated attention (q_proj gives each head's query and gate) on every fourth layer, Gated DeltaNet on the
# others: its four input projections fused as [qkv; z; b; a], the depthwise convolution, the decay's A_log and
# dt_bias, the gated norm's weight (a plain RMSNorm weight, unlike the blocks' 1 + w norms) and the output
QWEN3_5_WEIGHTS = llama_weights(**LLAMA_NORMS, **QK_NORMS) | {
    "layers.{i}.attn.in_proj.weight": (
        [_layer(f"linear_attn.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")],
        "cat",
    ),
    "layers.{i}.attn.conv": ([_layer("linear_attn.conv1d.weight")], ""),
    "layers.{i}.attn.A_log": ([_layer("linear_attn.A_log")], ""),
    "layers.{i}.attn.dt_bias": ([_layer("linear_attn.dt_bias")], ""),
    "layers.{i}.attn.gated_norm": ([_layer("linear_attn.norm.weight")], ""),
    "layers.{i}.attn.out.weight": ([_layer("linear_attn.out_proj.weight")], ""),
}

# Qwen3.5-MoE: Qwen3.5's mixers, every layer's FFN sparse with a shared expert behind a sigmoid gate; the experts
# per expert as the hub's files hold them, or stacked ([experts, 2 x size, hidden] gate | up) as transformers holds
# them in memory
_QWEN3_5_MOE = moe_weights(QWEN3_5_WEIGHTS, shared=True)
QWEN3_5_MOE_WEIGHTS = _QWEN3_5_MOE | {
    "layers.{i}.mlp.experts.{e}.up.weight": [
        _QWEN3_5_MOE["layers.{i}.mlp.experts.{e}.up.weight"],
        ([_layer("mlp.experts.gate_up_proj")], "expert"),
    ],
    "layers.{i}.mlp.experts.{e}.down.weight": [
        _QWEN3_5_MOE["layers.{i}.mlp.experts.{e}.down.weight"],
        ([_layer("mlp.experts.down_proj")], "expert"),
    ],
}

# Qwen3-Next: Qwen3.5-MoE's tensors but for DeltaNet's input projections, two whose rows are grouped by key head
# (in_proj_qkvz: each group's q, k, v, z; in_proj_ba: each group's b, a), which the loader regroups as kvserve's
# [q | k | v | z | b | a] ("ungroup_qkvz_ba": model/loader.py); dense MLPs on the layers the config says. A GGUF's
# are read as Qwen3.5's four (weights/gguf_arch.py: llama.cpp's converter splits them so), quantized as they are
QWEN3_NEXT_WEIGHTS = QWEN3_5_MOE_WEIGHTS | {
    "layers.{i}.attn.in_proj.weight": [
        (
            [_layer("linear_attn.in_proj_qkvz.weight"), _layer("linear_attn.in_proj_ba.weight")],
            "ungroup_qkvz_ba",
        ),
        QWEN3_5_WEIGHTS["layers.{i}.attn.in_proj.weight"],
    ],
}

GPT2_WEIGHTS: WeightNames = {
    "embed.weight": (["wte.weight"], ""),
    "pos_embed.weight": (["wpe.weight"], ""),
    "norm.weight": (["ln_f.weight"], ""),
    "norm.bias": (["ln_f.bias"], ""),
    "layers.{i}.norm1.weight": (["h.{i}.ln_1.weight"], ""),
    "layers.{i}.norm1.bias": (["h.{i}.ln_1.bias"], ""),
    "layers.{i}.norm2.weight": (["h.{i}.ln_2.weight"], ""),
    "layers.{i}.norm2.bias": (["h.{i}.ln_2.bias"], ""),
    "layers.{i}.attn.qkv.weight": (["h.{i}.attn.c_attn.weight"], "t"),
    "layers.{i}.attn.qkv.bias": (["h.{i}.attn.c_attn.bias"], ""),
    "layers.{i}.attn.o.weight": (["h.{i}.attn.c_proj.weight"], "t"),
    "layers.{i}.attn.o.bias": (["h.{i}.attn.c_proj.bias"], ""),
    "layers.{i}.mlp.up.weight": (["h.{i}.mlp.c_fc.weight"], "t"),
    "layers.{i}.mlp.up.bias": (["h.{i}.mlp.c_fc.bias"], ""),
    "layers.{i}.mlp.down.weight": (["h.{i}.mlp.c_proj.weight"], "t"),
    "layers.{i}.mlp.down.bias": (["h.{i}.mlp.c_proj.bias"], ""),
}


# What transformers reads for a config.json key that is absent: its config class's default. transformers 4.x's
# save_pretrained leaves a key out when its value is both PretrainedConfig's default and the class's (a tied Gemma's
# tie_word_embeddings, Llama's bos_token_id 1), so model/config.py reads every key through these, per class
# (4.57's and 5.x's agree). Left out: defaults of None, or derived from other keys (head_dim, num_key_value_heads
# from the heads), which the config reads as absent; keys whose default is kvserve's own fallback (attention_bias
# False, partial_rotary_factor 1); and the model's dims, which every config.json has.
LLAMA_DEFAULTS = dict(
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    hidden_act="silu",
)
MISTRAL_DEFAULTS = LLAMA_DEFAULTS | dict(
    max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096
)
QWEN_DEFAULTS = LLAMA_DEFAULTS | dict(
    bos_token_id=None,
    eos_token_id=None,
    max_position_embeddings=32768,
    num_key_value_heads=32,
    max_window_layers=28,
)
GRANITE_DEFAULTS = LLAMA_DEFAULTS | dict(
    embedding_multiplier=1.0, attention_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0
)
QWEN_MOE_DEFAULTS = LLAMA_DEFAULTS | dict(
    bos_token_id=None,
    eos_token_id=None,
    max_position_embeddings=32768,
    norm_topk_prob=False,
    decoder_sparse_step=1,
)
GEMMA_DEFAULTS = dict(
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=1,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    head_dim=256,
    num_key_value_heads=4,
    sliding_window=4096,
    query_pre_attn_scalar=256,
)


QWEN3_5_DEFAULTS = dict(  # Qwen3_5TextConfig's, Qwen3_5MoeTextConfig's and Qwen3NextConfig's alike
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    head_dim=256,
    hidden_act="silu",
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.25, rope_type="default"),
)


@dataclass(frozen=True)
class Moe:
    """How a MoE family's sparse layers are laid out and route (../shared/MODELS.md §5.1)."""

    # which layers are sparse: "all", or "qwen": all but those in the config's mlp_only_layers, every
    # decoder_sparse_step-th
    layers: str = "all"
    # the top k weights renormalized to sum to 1: always (Mixtral; Granite's softmax over the top k logits is the
    # same), never, or None: as the config's norm_topk_prob says
    renormalize: bool | None = None
    shared_expert: bool = False  # Qwen2-MoE: one more expert every token takes, behind a sigmoid gate
    bias: bool = False  # GPT-OSS: the router and the experts' projections have biases


@dataclass(frozen=True)
class Family:
    name: str
    weights: WeightNames = field(default_factory=lambda: llama_weights(**LLAMA_NORMS), compare=False)
    # where a block's norms sit: "pre" (Llama: before each branch), "sandwich" (Gemma: before and after each
    # branch), "post" (OLMo 2: after each branch only)
    block: str = "pre"
    qk_norm: str = ""  # "" | "head": RMSNorm over each head of q and k | "proj": over the whole projection
    qkv_bias: bool = False  # always (Qwen2); otherwise the config's attention_bias says
    norm_offset: float = 0.0  # Gemma: checkpoints store w - 1 of a norm that multiplies by w
    embedding_scale_sqrt_hidden: bool = False  # Gemma: embeddings times sqrt(hidden)
    # the window's layers when the config lists no layer_types: "all" (Mistral), "every N-th full" (Gemma 2: 2,
    # Gemma 3: 6), "qwen" (layers from max_window_layers on, when use_sliding_window)
    window_layers: str | int = ""
    layer_norm: bool = False  # GPT-2: LayerNorm, GELU MLP, learned positions
    mlp: str = ""  # the MLP's kind where the family fixes it (GPT-OSS's clamped_swiglu); "": from hidden_act
    attn_sinks: bool = False  # GPT-OSS: a learned logit per head in every softmax (`sinks`)
    moe: Moe | None = None  # sparse experts in place of the MLP (model/moe.py), in the layers Moe.layers says
    linear_attention: bool = False  # Gated DeltaNet layers where layer_types say linear_attention (Qwen3.5)
    attn_output_gate: bool = False  # Qwen3.5: attention's output times sigmoid(a gate q_proj also gives)
    # Gemma 4: full-attention layers with heads of their own (global_head_dim, num_global_key_value_heads, keys as
    # values where attention_k_eq_v), q/k norms that do the scaling (the scores' scale is 1), values normed per head
    # (no weight), each block's output times a loaded layer_scalar, and per-layer embeddings
    # (hidden_size_per_layer_input); the last layer is always full attention
    gemma4: bool = False
    # config.json key -> transformers' default for it (see LLAMA_DEFAULTS above); tests/model/test_config_defaults.py
    # checks each against the class and that nothing else is read
    config_defaults: dict = field(default_factory=dict, compare=False)


# Gemma 4: Gemma 3's block (no 1 + w norms), a layer_scalar per block, full-attention layers without v_proj where
# keys are values, and the per-layer embeddings (PLE): a table of per-layer token embeddings, a projection of the
# token's embedding to every layer's input and its norm; in each layer, a gate, a projection back and a norm
GEMMA4_WEIGHTS = llama_weights(**GEMMA_NORMS, **QK_NORMS) | {
    "layers.{i}.attn.qkv.weight": [
        ([_layer(f"self_attn.{p}_proj.weight") for p in "qkv"], "cat"),
        ([_layer(f"self_attn.{p}_proj.weight") for p in "qk"], "cat"),
        ([_layer("self_attn.q_proj.weight")], ""),  # a layer that reads an earlier one's K/V
    ],
    "layers.{i}.layer_scalar": ([_layer("layer_scalar")], ""),
    "per_layer_embed.weight": (["model.embed_tokens_per_layer.weight"], ""),
    "per_layer_projection.weight": (["model.per_layer_model_projection.weight"], ""),
    "per_layer_norm.weight": (["model.per_layer_projection_norm.weight"], ""),
    "layers.{i}.per_layer_gate.weight": ([_layer("per_layer_input_gate.weight")], ""),
    "layers.{i}.per_layer_projection.weight": ([_layer("per_layer_projection.weight")], ""),
    "layers.{i}.per_layer_norm.weight": ([_layer("post_per_layer_input_norm.weight")], ""),
    # 26B-A4B's FFN: the dense MLP and its norm after, the experts (stacked, gate and up in one) with their norms
    # before and after, and the router's projection, input scale and per-expert scales
    "layers.{i}.mlp.dense.up.weight": ([_layer("mlp.gate_proj.weight"), _layer("mlp.up_proj.weight")], "cat"),
    "layers.{i}.mlp.dense.down.weight": ([_layer("mlp.down_proj.weight")], ""),
    "layers.{i}.mlp.dense_norm.weight": ([_layer("post_feedforward_layernorm_1.weight")], ""),
    "layers.{i}.mlp.moe_in_norm.weight": ([_layer("pre_feedforward_layernorm_2.weight")], ""),
    "layers.{i}.mlp.moe_norm.weight": ([_layer("post_feedforward_layernorm_2.weight")], ""),
    "layers.{i}.mlp.moe.router.weight": ([_layer("router.proj.weight")], ""),
    "layers.{i}.mlp.moe.router_scale": ([_layer("router.scale")], ""),
    "layers.{i}.mlp.moe.expert_scale": ([_layer("router.per_expert_scale")], ""),
    "layers.{i}.mlp.moe.experts.{e}.up.weight": ([_layer("experts.gate_up_proj")], "expert"),
    "layers.{i}.mlp.moe.experts.{e}.down.weight": ([_layer("experts.down_proj")], "expert"),
}

# A multimodal checkpoint's text model: the family it is, its config under text_config and its weights under
# model.language_model (kvserve serves the text; the vision tower's weights are left unread)
TEXT_MODEL_OF = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}

FAMILIES = {
    f.name: f
    for f in (
        Family("LlamaForCausalLM", config_defaults=LLAMA_DEFAULTS),
        Family("MistralForCausalLM", window_layers="all", config_defaults=MISTRAL_DEFAULTS),
        Family("MinistralForCausalLM", window_layers="all", config_defaults=MISTRAL_DEFAULTS),
        Family("Qwen2ForCausalLM", qkv_bias=True, window_layers="qwen", config_defaults=QWEN_DEFAULTS),
        Family(
            "Qwen3ForCausalLM",
            llama_weights(**LLAMA_NORMS, **QK_NORMS),
            qk_norm="head",
            window_layers="qwen",
            config_defaults=QWEN_DEFAULTS | dict(head_dim=128),
        ),
        Family(
            "SmolLM3ForCausalLM",
            window_layers="qwen",
            config_defaults=LLAMA_DEFAULTS
            | dict(
                tie_word_embeddings=True,
                bos_token_id=128000,
                eos_token_id=128001,
                max_position_embeddings=32768,
                rope_theta=2000000.0,
                num_key_value_heads=4,
            ),
        ),
        Family("GraniteForCausalLM", config_defaults=GRANITE_DEFAULTS),
        Family(
            "Gemma2ForCausalLM",
            llama_weights(**GEMMA_NORMS),
            block="sandwich",
            norm_offset=1.0,
            embedding_scale_sqrt_hidden=True,
            window_layers=2,
            config_defaults=GEMMA_DEFAULTS
            | dict(
                max_position_embeddings=8192,
                rope_theta=10000.0,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
            ),
        ),
        Family(
            "Gemma3ForCausalLM",
            llama_weights(**GEMMA_NORMS, **QK_NORMS),
            block="sandwich",
            qk_norm="head",
            norm_offset=1.0,
            embedding_scale_sqrt_hidden=True,
            window_layers=6,
            # the config class is Gemma3TextConfig; sliding layers rotate with rope_local_base_freq
            config_defaults=GEMMA_DEFAULTS
            | dict(max_position_embeddings=131072, rope_theta=1000000.0, rope_local_base_freq=10000.0),
        ),
        Family(
            "Gemma4ForCausalLM",  # the text model (Gemma4TextConfig): Gemma 4 31B, 26B-A4B, E2B, E4B
            GEMMA4_WEIGHTS,
            block="sandwich",
            qk_norm="head",
            embedding_scale_sqrt_hidden=True,
            window_layers=6,
            gemma4=True,
            # Gemma4TextConfig's: Gemma's, without query_pre_attn_scalar (its q/k norms scale)
            config_defaults={k: v for k, v in GEMMA_DEFAULTS.items() if k != "query_pre_attn_scalar"}
            | dict(
                max_position_embeddings=131072,
                sliding_window=512,
                attention_bias=False,
                final_logit_softcapping=None,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {
                        "rope_type": "proportional",
                        "partial_rotary_factor": 0.25,
                        "rope_theta": 1000000.0,
                    },
                },
                attention_k_eq_v=False,
                num_kv_shared_layers=0,
                hidden_size_per_layer_input=256,
                vocab_size_per_layer_input=262144,
                enable_moe_block=False,
                use_double_wide_mlp=False,
                use_bidirectional_attention=None,
            ),
        ),
        Family(
            "Olmo2ForCausalLM",
            llama_weights(
                post_attn_norm="post_attention_layernorm",
                post_mlp_norm="post_feedforward_layernorm",
                **QK_NORMS,
            ),
            block="post",
            qk_norm="proj",
            config_defaults=LLAMA_DEFAULTS | dict(bos_token_id=None, eos_token_id=50279, rms_norm_eps=1e-5),
        ),
        Family(
            "Phi3ForCausalLM",
            PHI3_WEIGHTS,
            window_layers="all",
            config_defaults=LLAMA_DEFAULTS
            | dict(
                eos_token_id=32000,
                rms_norm_eps=1e-5,
                max_position_embeddings=4096,
                original_max_position_embeddings=4096,
            ),
        ),
        Family(
            "GPT2LMHeadModel",
            GPT2_WEIGHTS,
            layer_norm=True,
            config_defaults=dict(
                tie_word_embeddings=True,
                bos_token_id=50256,
                eos_token_id=50256,
                n_positions=1024,
                layer_norm_epsilon=1e-5,
            ),
        ),
        Family(
            "Qwen3MoeForCausalLM",
            moe_weights(llama_weights(**LLAMA_NORMS, **QK_NORMS)),
            qk_norm="head",
            window_layers="qwen",
            moe=Moe(layers="qwen"),
            config_defaults=QWEN_MOE_DEFAULTS
            | dict(num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        ),
        Family(
            "Qwen2MoeForCausalLM",
            moe_weights(llama_weights(**LLAMA_NORMS), shared=True),
            qkv_bias=True,
            window_layers="qwen",
            moe=Moe(layers="qwen", shared_expert=True),
            config_defaults=QWEN_MOE_DEFAULTS
            | dict(
                num_key_value_heads=16,
                max_window_layers=28,
                num_experts=60,
                num_experts_per_tok=4,
                moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632,
            ),
        ),
        Family(
            "OlmoeForCausalLM",
            moe_weights(llama_weights(**LLAMA_NORMS, **QK_NORMS)),
            qk_norm="proj",
            moe=Moe(),
            config_defaults=LLAMA_DEFAULTS
            | dict(
                bos_token_id=None,
                eos_token_id=50279,
                rms_norm_eps=1e-5,
                max_position_embeddings=4096,
                num_key_value_heads=16,
                num_experts=64,
                num_experts_per_tok=8,
                norm_topk_prob=False,
            ),
        ),
        Family(
            "GraniteMoeForCausalLM",
            GRANITE_MOE_WEIGHTS,
            moe=Moe(renormalize=True),
            config_defaults=GRANITE_DEFAULTS
            | dict(num_key_value_heads=32, num_experts=8, num_experts_per_tok=2),
        ),
        Family(
            "MixtralForCausalLM",
            moe_weights(llama_weights(**LLAMA_NORMS), "block_sparse_moe", gate_up_down=("w1", "w3", "w2")),
            window_layers="all",
            moe=Moe(renormalize=True),
            config_defaults=LLAMA_DEFAULTS
            | dict(
                rms_norm_eps=1e-5,
                max_position_embeddings=131072,
                num_key_value_heads=8,
                rope_theta=1000000.0,
                num_experts=8,
                num_experts_per_tok=2,
            ),
        ),
        Family(
            "GptOssForCausalLM",
            GPT_OSS_WEIGHTS,
            mlp="clamped_swiglu",
            attn_sinks=True,
            window_layers=2,  # where the config lists no layer_types: sliding first, then every other layer
            # top k of the router's logits, softmax over those k: the renormalized top k of the softmax
            moe=Moe(renormalize=True, bias=True),
            config_defaults=dict(
                tie_word_embeddings=False,
                bos_token_id=None,
                eos_token_id=None,
                rms_norm_eps=1e-5,
                max_position_embeddings=131072,
                num_key_value_heads=8,
                head_dim=64,
                sliding_window=128,
                attention_bias=True,
                num_experts=128,
                num_experts_per_tok=4,
                swiglu_alpha=1.702,
                swiglu_limit=7.0,
                rope_parameters=dict(
                    rope_type="yarn",
                    factor=32.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=4096,
                    rope_theta=150000.0,
                ),
            ),
        ),
        Family(
            "Qwen3_5ForCausalLM",  # the text model (Qwen3_5TextConfig)
            QWEN3_5_WEIGHTS,
            qk_norm="head",
            norm_offset=1.0,  # zero-centred RMSNorm: x * (1 + w), the q/k norms too
            linear_attention=True,
            attn_output_gate=True,
            config_defaults=QWEN3_5_DEFAULTS | dict(num_key_value_heads=4),
        ),
        Family(
            "Qwen3_5MoeForCausalLM",  # the text model (Qwen3_5MoeTextConfig): Qwen3.5/3.6-35B-A3B, 122B-A10B
            QWEN3_5_MOE_WEIGHTS,
            qk_norm="head",
            norm_offset=1.0,
            linear_attention=True,
            attn_output_gate=True,
            moe=Moe(renormalize=True, shared_expert=True),  # softmax, top k renormalized, on every layer
            config_defaults=QWEN3_5_DEFAULTS
            | dict(
                num_key_value_heads=2,
                num_experts=256,
                num_experts_per_tok=8,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
            ),
        ),
        Family(
            "Qwen3NextForCausalLM",  # Qwen3-Next-80B-A3B: Qwen3.5-MoE's blocks, a release earlier
            QWEN3_NEXT_WEIGHTS,
            qk_norm="head",
            norm_offset=1.0,
            linear_attention=True,
            attn_output_gate=True,
            # softmax, top k renormalized as norm_topk_prob says; dense where mlp_only_layers and
            # decoder_sparse_step say
            moe=Moe(layers="qwen", shared_expert=True),
            config_defaults=QWEN3_5_DEFAULTS
            | dict(
                num_key_value_heads=2,
                num_experts=512,
                num_experts_per_tok=10,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
                norm_topk_prob=True,
                decoder_sparse_step=1,
            ),
        ),
    )
}
