"""What each GGUF architecture llama.cpp writes means in Hugging Face terms: one Family per architecture.

A Family says which Hugging Face class the folder becomes, which GGUF tensor inside blk.N is which Hugging Face
tensor inside model.layers.N, what llama.cpp's converter (convert_hf_to_gguf.py, conversion/*.py) did to the
values on the way in (q/k rows reordered for its interleaved RoPE, +1 baked into Gemma's norms), which metadata keys
hold which config fields, and what llama.cpp hard-codes instead of storing (Gemma 3's 5:1 window pattern, SmolLM3's
NoPE layers, Gemma's attention scale). weights/gguf_convert.py applies it; nothing here reads a file.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from weights.gguf_tokenizer import UnsupportedGGUFError

# GGUF tensor inside blk.N -> Hugging Face module inside model.layers.N, for a Llama block.
LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 2/3: norms after attention and around the MLP. Hugging Face's post_attention_layernorm is llama.cpp's
# post_attention_norm here, where in a Llama block it is ffn_norm.
GEMMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps q/k/v in one matrix (rows q | k | v) and gate/up in one (rows gate | up), as Hugging Face does.
PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# OLMo 2 normalizes after attention and after the MLP, never before; its q/k norms span all heads.
OLMO2_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
} | QK_NORMS
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")


def moe_layer(
    moe: str = "mlp", gate_up_down: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> dict:
    """A sparse FFN's tensors: the router, and each expert's gate, up and down, which llama.cpp's converter stacks
    into one 3-D tensor per kind ([experts, rows, K] in numpy's order; `{e}` is an expert's index in Hugging
    Face's per-expert names). `moe` names the FFN module (Mixtral's block_sparse_moe)."""
    gate, up, down = (f"{moe}.experts.{{e}}.{name}" for name in gate_up_down)
    return {"ffn_gate_inp": f"{moe}.gate", "ffn_gate_exps": gate, "ffn_up_exps": up, "ffn_down_exps": down}


# every layer sparse: llama.cpp's qwen2moe, qwen3moe, olmoe, granitemoe and Mixtral builds have no dense FFN beside
# experts
SPARSE_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k not in DENSE_FFN}
# Granite MoE keeps every expert's in one Hugging Face tensor: input_linear [experts, 2 x size, hidden], each
# expert's gate rows then its up rows (llama.cpp's converter splits it there into ffn_gate_exps and ffn_up_exps),
# and output_linear [experts, hidden, size]
GRANITE_MOE_FFN = {
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_up_exps": "block_sparse_moe.input_linear",
    "ffn_down_exps": "block_sparse_moe.output_linear",
}
# GPT-OSS (llama.cpp's gpt-oss): a norm after attention in the MLP's place, a sink logit per head, a router with a
# bias, and the experts' gate, up and down (each with a bias) one tensor per kind, as the other MoE files; Hugging
# Face's tensor of every expert's interleaved gate/up columns ([experts, hidden, 2 x size]) has no row-wise
# counterpart in GGUF, so the experts read under per-expert names (model/families.py's GPT-OSS row takes both)
GPT_OSS_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k not in (*DENSE_FFN, "ffn_norm")} | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
# Qwen3.5/3.6 (llama.cpp's qwen35, qwen35moe; conversion/qwen.py): gated attention (q_proj's rows each head's query
# then its gate, as Hugging Face's) on every full_attention_interval-th layer, Gated DeltaNet on the others. Its
# in_proj_qkv is llama.cpp's attn_qkv (the DeltaNet's [q; k; v], not a fused attention), in_proj_z its attn_gate,
# in_proj_b / in_proj_a ssm_beta / ssm_alpha; dt_bias is written as ssm_dt.bias and A_log as ssm_a, no suffix.
QWEN35_ATTENTION = {
    k: v for k, v in (LLAMA_LAYER | QK_NORMS).items() if k.startswith("attn_") and k != "attn_norm"
}
QWEN35_DELTANET = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# llama.cpp's converters store a state-space decay's A_log as ssm_a = -exp(A_log) (Mamba, Qwen3-Next, Qwen3.5)
NEGATED_EXP = ("ssm_a",)
# each mixer's tensors, in the layers of its type only (Family.mixer_tensors)
QWEN35_MIXERS = {"full_attention": tuple(QWEN35_ATTENTION), "linear_attention": tuple(QWEN35_DELTANET)}
QWEN35_LAYER = (
    {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
    | QWEN35_ATTENTION
    | QWEN35_DELTANET
)
# Qwen3-Next (llama.cpp's qwen3next; conversion/qwen.py's Qwen3NextModel): Qwen3.5-MoE's layers, but Hugging Face
# groups two of DeltaNet's projections by key head. The converter writes in_proj_qkvz regrouped, split as attn_qkv
# [q | k | v] and attn_gate [z] (an older one wrote it as it is: ssm_in, which llama.cpp still reads), and
# in_proj_ba as it is, ssm_ba. The value heads stay in Hugging Face's order (the tiling is Qwen3.5's only). Served
# under Qwen3.5's names of the four projections (model/families.py's QWEN3_NEXT_WEIGHTS reads them), so that
# attn_qkv and attn_gate keep their blocks as they are: transformers' grouped in_proj_qkvz would be regrouped at
# load, dequantized.
GROUPED_BY_KEY_HEAD = ("ssm_in", "ssm_ba")
# Qwen2-MoE's shared expert, which every token takes, scaled by sigmoid(ffn_gate_inp_shexp . x)
SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


# Gemma 4 (conversion/gemma.py's Gemma4Model): Gemma 3's layer with plain w norms, a scalar on the layer's output,
# the per-layer inputs' gate, projection and norm, and (26B-A4B) experts beside the dense MLP: the router's
# projection and input scale, every expert's gate and up in one tensor and down in another, each expert's output
# scale (".scale" tensors, no ".weight"), and the norms around the two branches
GEMMA4_PER_LAYER_INPUT = {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
GEMMA4_MOE = {
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
GEMMA4_LAYER = (
    GEMMA_LAYER | QK_NORMS | {"layer_output_scale": "layer_scalar"} | GEMMA4_PER_LAYER_INPUT | GEMMA4_MOE
)
GEMMA4_BARE = (
    "layer_output_scale",
    "ffn_gate_inp.scale",
    "ffn_gate_up_exps",
    "ffn_down_exps",
    "ffn_down_exps.scale",
)


def shortest_float(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Write the shortest decimal of the same float32."""
    return float(str(np.float32(value)))


ATTENTION_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")
MLP_BIASES = ("ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class BiasGroup:
    """Biases that one Hugging Face config switch turns on together (a switch of None: always there)."""

    switch: str | None
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    architecture: str  # Hugging Face `architectures[0]`
    model_type: str
    layer_tensors: dict[str, str]
    # config field -> (GGUF key after "<arch>.", default or REQUIRED), beyond COMMON_KEYS
    keys: dict[str, tuple[str, Any]] = field(default_factory=dict)
    constants: dict[str, Any] = field(default_factory=dict)
    biases: tuple[BiasGroup, ...] = ()
    # llama.cpp's converter reorders q/k rows for its interleaved ("NORM") RoPE: LlamaModel.modify_tensors and the
    # subclasses that keep undo_permute (Granite, SmolLM3), not Qwen, Gemma, Phi-3 or OLMo 2 (NEOX RoPE).
    permute_qk: bool = False
    # what the converter added to every *norm.weight (Gemma's x * (1 + w) stored as x * w')
    norm_shift: float = 0.0
    qk_norm_per_head: bool = True  # False: q/k norms span heads * head_dim (OLMo 2)
    # RoPE tensors llama.cpp reads for this architecture: a llama3 `rope_freqs`, or Phi-3's LongRoPE factors
    rope_tensors: tuple[str, ...] = ()
    partial_rotary: bool = False  # rope.dimension_count may be below head_dim
    linear_rope_scaling: bool = True  # Hugging Face's class accepts rope_scaling {type: linear}
    # family-specific config fields: (GGUF metadata, the config so far) -> fields to add
    extra: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    # GGUF tensors whose Hugging Face counterpart is a bare parameter, `<module>`, not `<module>.weight` (sinks)
    bare: tuple[str, ...] = ()
    yarn_truncate: bool | None = None  # YaRN's `truncate` where the release's config sets it (GPT-OSS: false)
    # why its Hugging Face folder cannot be written from the GGUF's tensors as they are (GPT-OSS's experts): served
    # in place only; "": convertible
    in_place_only: str = ""
    # layer type -> the tensors only layers of that type hold (a hybrid's mixers); the rest are in every layer
    mixer_tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unshifted: tuple[str, ...] = ()  # norms the converter left without norm_shift (Qwen3.5's gated ssm_norm)
    # Gated DeltaNet's value heads stored tiled by llama.cpp's converter (value_head_order)
    tiled_value_heads: bool = False
    # Qwen3-Next's ssm_ba (and an older file's ssm_in): rows grouped by key head (key_head_groups)
    grouped_by_key_head: bool = False
    # GGUF keys (after "<arch>.") that may hold one value per layer (Gemma 4's head_count_kv, feed_forward_length):
    # read as lists, which `extra` makes config fields of
    per_layer_keys: tuple[str, ...] = ()
    # tensors outside blk.N (beyond token_embd, output_norm, output): GGUF name -> Hugging Face module
    global_tensors: dict[str, str] = field(default_factory=dict)
    # config fields read from the tensors themselves (which exist, a RoPE tensor's values), in place of
    # rope_config: (GGUF metadata, the config so far, GGUF tensor name -> shape, RoPE tensors by name) -> fields
    from_tensors: Callable[..., dict[str, Any]] | None = None
    # (config, layer) -> the tensors layer `layer` leaves out (Gemma 4's layers that read another's K/V)
    absent: Callable[[dict[str, Any], int], set[str]] | None = None
    # (config, layer) -> its (head dim, KV heads, FFN size), where layers differ (Gemma 4's)
    layer_dims: Callable[[dict[str, Any], int], tuple[int, int, int]] | None = None
    dense_and_experts: bool = False  # a dense FFN beside the experts in a sparse layer (Gemma 4 26B-A4B)

    @property
    def convertible(self) -> bool:
        return not self.in_place_only

    def layer_tensors_of(self, config: dict[str, Any], layer: int) -> dict[str, str]:
        """The GGUF tensors layer `layer` holds (a hybrid's: its mixer's), by name inside blk.N."""
        absent = self.absent(config, layer) if self.absent else set()
        if self.mixer_tensors:
            kind = config["layer_types"][layer]
            absent |= {name for mixer, names in self.mixer_tensors.items() if mixer != kind for name in names}
        return {k: v for k, v in self.layer_tensors.items() if k not in absent}


REQUIRED = object()  # a key without a default
# config field -> (GGUF key after "<arch>.", default): what every family stores alike
COMMON_KEYS = {
    "hidden_size": ("embedding_length", REQUIRED),
    "intermediate_size": ("feed_forward_length", REQUIRED),
    "num_hidden_layers": ("block_count", REQUIRED),
    "num_attention_heads": ("attention.head_count", REQUIRED),
    "max_position_embeddings": ("context_length", REQUIRED),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", REQUIRED),
    "rope_theta": ("rope.freq_base", 10000.0),  # llama.cpp's default (Gemma 2's converter never writes it)
}


def arch_key(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    return meta.get(f"{meta['general.architecture']}.{key}", default)


def read_keys(
    meta: dict[str, Any], keys: dict[str, tuple[str, Any]], per_layer: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Config fields from GGUF keys: floats as the shortest decimal of their float32, one value for all layers
    (a list where the key is one of `per_layer`)."""
    fields = {}
    for name, (key, default) in keys.items():
        value = arch_key(meta, key, default)
        if value is REQUIRED:
            raise UnsupportedGGUFError(f"GGUF metadata has no {meta['general.architecture']}.{key!r}")
        if isinstance(value, list) and key in per_layer:
            fields[name] = value
            continue
        if isinstance(value, list):
            raise UnsupportedGGUFError(f"per-layer {key} ({value[:4]}...) is not supported")
        fields[name] = shortest_float(value) if isinstance(value, float) else value
    return fields


def window_pattern(meta: dict[str, Any], num_layers: int, every: int) -> list[str]:
    """Hugging Face layer_types from `attention.sliding_window_pattern` (a bool per layer, or a period), else the
    period llama.cpp hard-codes: layer i slides unless i % every == every - 1 (llama_hparams::set_swa_pattern)."""
    pattern = arch_key(meta, "attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise UnsupportedGGUFError(
                f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers"
            )
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gemma_attention_scalar(config: dict[str, Any], large_layers: int) -> int:
    """llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the largest model (Gemma 2 27B:
    46 layers, Gemma 3 27B: 62), and stores neither: Hugging Face's query_pre_attn_scalar is that number."""
    if config["num_hidden_layers"] == large_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def gemma2_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    swa_base = arch_key(meta, "rope.freq_base_swa")
    if swa_base is not None and shortest_float(swa_base) != config["rope_theta"]:
        raise UnsupportedGGUFError(f"gemma2 with a local RoPE base ({swa_base}) apart from the global one")
    return {
        "query_pre_attn_scalar": gemma_attention_scalar(config, large_layers=46),
        "layer_types": window_pattern(meta, config["num_hidden_layers"], every=2),
    }


def gemma3_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    window = arch_key(meta, "attention.sliding_window", 0)
    softcap = arch_key(meta, "final_logit_softcapping", 0.0)
    layers = config["num_hidden_layers"]
    return {
        "query_pre_attn_scalar": gemma_attention_scalar(config, large_layers=62),
        "sliding_window": window or None,
        # without a window llama.cpp runs every layer as full attention
        "layer_types": window_pattern(meta, layers, every=6) if window else ["full_attention"] * layers,
        "final_logit_softcapping": shortest_float(softcap) if softcap else None,
        "attn_logit_softcapping": None,
    }


def gemma4_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 (llama.cpp's gemma4; conversion/gemma.py's Gemma4Model): the layer pattern as a list; the full
    layers' head size in key_length and the sliding layers' in key_length_swa; KV heads and FFN sizes per layer
    where they differ (the full layers' fewer heads, the KV-sharing layers' double-wide MLPs)."""
    n = config["num_hidden_layers"]
    kinds = window_pattern(meta, n, every=6)
    shared = arch_key(meta, "attention.shared_kv_layers", 0)
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    kv = per_layer(config["num_key_value_heads"], n)
    ffn = per_layer(config["intermediate_size"], n)
    fields = {
        "layer_types": kinds,
        "head_dim": arch_key(meta, "attention.key_length_swa", config["head_dim"]),
        "global_head_dim": config["head_dim"],
        "num_key_value_heads": kv[sliding[0]] if sliding else kv[0],
        "intermediate_size": ffn[0],
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": any(ffn[i] == 2 * ffn[0] for i in range(n - shared, n)) if shared else False,
        "hidden_size_per_layer_input": arch_key(meta, "embedding_length_per_layer_input", 0),
        "sliding_window": arch_key(meta, "attention.sliding_window", 512),
        "final_logit_softcapping": shortest_float(softcap)
        if (softcap := arch_key(meta, "final_logit_softcapping"))
        else None,
    }
    if {kv[i] for i in sliding} - {fields["num_key_value_heads"]} or len({kv[i] for i in full}) > 1:
        raise UnsupportedGGUFError(
            f"gemma4 with KV heads {kv} per layer, other than one count per layer kind"
        )
    sizes = {ffn[i] for i in range(n - shared)} | {
        ffn[i] // (2 if fields["use_double_wide_mlp"] else 1) for i in range(n - shared, n)
    }
    if sizes != {ffn[0]}:
        raise UnsupportedGGUFError(f"gemma4 with FFN sizes {ffn} per layer")
    if full and kv[full[0]] != fields["num_key_value_heads"]:
        fields["num_global_key_value_heads"] = kv[full[0]]
    if experts := arch_key(meta, "expert_count", 0):
        fields |= {
            "enable_moe_block": True,
            "num_experts": experts,
            "top_k_experts": arch_key(meta, "expert_used_count"),
            "moe_intermediate_size": arch_key(meta, "expert_feed_forward_length"),
        }
    return fields


def per_layer(value: int | list[int], n: int) -> list[int]:
    """A per-layer key's values, whether the file holds one for every layer or one for all."""
    return list(value) if isinstance(value, list) else [value] * n


def gemma4_from_tensors(
    meta: dict[str, Any],
    config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    rope: dict[str, np.ndarray],
) -> dict[str, Any]:
    """Gemma 4's fields that only its tensors say: keys as values where its full layers have no attn_v (checked
    against the first full layer that keeps K/V), the per-layer embeddings' rows, and its RoPE: the sliding
    layers' default, the full layers' proportional one, whose turning share llama.cpp stores as rope_freqs, 1 for
    a pair that turns and 1e30 for one that stays."""
    kinds = config["layer_types"]
    owners = range(config["num_hidden_layers"] - config["num_kv_shared_layers"])
    full = next((i for i in owners if kinds[i] == "full_attention"), None)
    fields = {"attention_k_eq_v": full is not None and f"blk.{full}.attn_v.weight" not in shapes}
    if config["hidden_size_per_layer_input"]:
        fields["vocab_size_per_layer_input"] = int(shapes["per_layer_token_embd.weight"][1])
    swa_dims = arch_key(meta, "rope.dimension_count_swa", config["head_dim"])
    if swa_dims != config["head_dim"]:
        raise UnsupportedGGUFError(
            f"gemma4 sliding layers with partial rotary ({swa_dims} of {config['head_dim']})"
        )
    full_rope = {"rope_type": "default", "rope_theta": shortest_float(arch_key(meta, "rope.freq_base", 1e6))}
    if "rope_freqs" in rope:
        factors = rope["rope_freqs"].astype(np.float64)
        turning = int((factors == 1.0).sum())
        if (
            len(factors) * 2 != config["global_head_dim"]
            or not (factors[:turning] == 1.0).all()
            or (factors[turning:] < 1e29).any()
        ):
            raise UnsupportedGGUFError(f"gemma4 rope_freqs other than proportional RoPE's ({factors[:4]}...)")
        full_rope |= {"rope_type": "proportional", "partial_rotary_factor": turning / len(factors)}
    swa_theta = shortest_float(arch_key(meta, "rope.freq_base_swa", 10000.0))
    fields["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": swa_theta},
        "full_attention": full_rope,
    }
    return fields


def gemma4_absent(config: dict[str, Any], layer: int) -> set[str]:
    """The tensors a Gemma 4 layer leaves out: K/V's where it reads an earlier layer's, V where a full layer's
    keys are its values, the per-layer inputs' and the experts' where the model has none."""
    absent = set()
    if layer >= config["num_hidden_layers"] - config["num_kv_shared_layers"]:
        absent |= {"attn_k", "attn_v", "attn_k_norm"}
    elif config.get("attention_k_eq_v") and config["layer_types"][layer] == "full_attention":
        absent.add("attn_v")
    if not config.get("hidden_size_per_layer_input"):
        absent |= set(GEMMA4_PER_LAYER_INPUT)
    if not config.get("enable_moe_block"):
        absent |= set(GEMMA4_MOE)
    return absent


def gemma4_layer_dims(config: dict[str, Any], layer: int) -> tuple[int, int, int]:
    """A Gemma 4 layer's (head dim, KV heads, FFN size)."""
    full = config["layer_types"][layer] == "full_attention"
    head_dim = config["global_head_dim"] if full else config["head_dim"]
    kv = config.get("num_global_key_value_heads") if full else None
    shared = layer >= config["num_hidden_layers"] - config["num_kv_shared_layers"]
    ffn = config["intermediate_size"] * (2 if shared and config["use_double_wide_mlp"] else 1)
    return head_dim, kv or config["num_key_value_heads"], ffn


def granite_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    if not arch_key(meta, "rope.scaling.finetuned", True):
        raise UnsupportedGGUFError("granite without RoPE (rope.scaling.finetuned = false)")
    return granite_scalars(meta, config)


def granite_scalars(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (llama.cpp's *_scale keys) but the logits', a key of its own."""

    def scale(key: str, default: float) -> float:
        # llama.cpp skips a scale of 0 (absent), and uses 1/sqrt(head_dim) for an absent attention scale
        value = arch_key(meta, key, 0.0)
        return shortest_float(value) if value else default

    return {
        "embedding_multiplier": scale("embedding_scale", 1.0),
        "residual_multiplier": scale("residual_scale", 1.0),
        "attention_multiplier": scale("attention.scale", config["head_dim"] ** -0.5),
    }


def smollm3_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp hard-codes NoPE on every 4th layer (n_no_rope_layer_step = 4); 1 means "apply RoPE"
    interval = 4
    layers = config["num_hidden_layers"]
    return {
        "no_rope_layer_interval": interval,
        "no_rope_layers": [int((i + 1) % interval != 0) for i in range(layers)],
    }


def olmo2_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    if arch_key(meta, "attention.sliding_window"):
        raise UnsupportedGGUFError("olmo2 with a sliding window (OLMo 3) is not supported")
    return {}


def phi3_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    window = arch_key(meta, "attention.sliding_window", 0)
    return {
        # the converter writes the pretraining context even without long-context factors
        "original_max_position_embeddings": arch_key(
            meta, "rope.scaling.original_context_length", config["max_position_embeddings"]
        ),
        "sliding_window": window or None,  # llama.cpp ignores it; Hugging Face's Phi-3 attends within it
    }


def moe_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What kvserve's router (softmax over every expert, top k, weights unscaled) cannot follow is refused."""
    gating = arch_key(meta, "expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    if gating != 1:
        raise UnsupportedGGUFError(f"expert_gating_func {gating} (only softmax, 1, is supported)")
    scale = arch_key(meta, "expert_weights_scale", 0.0)  # 0: absent; llama.cpp scales by anything else but 1
    if scale not in (0.0, 1.0):
        raise UnsupportedGGUFError(f"expert_weights_scale {scale} is not supported")
    return {}


def qwen2moe_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return moe_config(meta, config) | {
        # llama.cpp's qwen2moe build never renormalizes the top k (as Qwen1.5-MoE's norm_topk_prob: false);
        # a file that says otherwise is followed, as its Hugging Face model would be
        "norm_topk_prob": bool(arch_key(meta, "expert_weights_norm", False)),
        # llama.cpp's default for an absent size: feed_forward_length
        "shared_expert_intermediate_size": arch_key(
            meta, "expert_shared_feed_forward_length", config["intermediate_size"]
        ),
    }


def granitemoe_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's granitemoe build (src/models/granite-moe.cpp, granite.cpp's graph): RoPE on every layer
    whatever rope.scaling.finetuned says (unlike granite's), softmax over every expert, the top k renormalized,
    as Hugging Face's softmax over the top k logits is. GraniteMoeShared (a shared expert beside the routed ones,
    written as granitemoe with expert_shared_feed_forward_length) and a granitemoe without experts (a dense FFN)
    have no Hugging Face class kvserve runs."""
    if config["num_local_experts"] == 0:
        raise UnsupportedGGUFError("granitemoe without experts (expert_count 0) is not supported")
    if shared := arch_key(meta, "expert_shared_feed_forward_length", 0):
        raise UnsupportedGGUFError(
            f"granitemoe with a shared expert (GraniteMoeShared, expert_shared_feed_forward_length {shared}) "
            "is not supported"
        )
    return moe_config(meta, config) | granite_scalars(meta, config)


def olmoe_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    if arch_key(meta, "attention.clamp_kqv"):
        raise UnsupportedGGUFError("olmoe with clip_qkv (attention.clamp_kqv) is not supported")
    return moe_config(meta, config)


def gpt_oss_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's gpt-oss build (src/models/openai-moe.cpp): a window on every other layer from the first
    (set_swa_pattern(2)), the softmax over the top k logits, and the clamped SwiGLU of GPT-OSS's release (alpha
    1.702, limit 7), which it hard-codes rather than stores; its YaRN as the release's config (not truncated)."""
    window = arch_key(meta, "attention.sliding_window", 0)
    if not window:
        raise UnsupportedGGUFError("gpt-oss without attention.sliding_window")
    if arch_key(meta, "rope.scaling.type") != "yarn":
        raise UnsupportedGGUFError(
            f"gpt-oss with rope scaling {arch_key(meta, 'rope.scaling.type')!r}, not yarn"
        )
    return {
        "sliding_window": window,
        "layer_types": window_pattern(meta, config["num_hidden_layers"], every=2),
        "swiglu_limit": 7.0,
    }


def qwen35_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's qwen35/qwen35moe (src/models/qwen35.cpp's load_arch_hparams): block_count counts the
    multi-token-prediction layers (nextn_predict_layers, dense attention blocks after the model's, which kvserve
    does not run and skips); attention.recurrent_layers flags each DeltaNet layer, else a layer is one unless
    (i + 1) % full_attention_interval == 0. A DeltaNet value head is ssm.inner_size / ssm.time_step_rank wide.
    rope.dimension_sections (Qwen3.5's interleaved mRoPE) rotate as plain RoPE with text-only positions."""
    mtp = arch_key(meta, "nextn_predict_layers", 0)
    layers = config["num_hidden_layers"] - mtp
    recurrent = arch_key(meta, "attention.recurrent_layers")
    if recurrent is None:
        every = arch_key(meta, "full_attention_interval", 4)
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    inner, value_heads = arch_key(meta, "ssm.inner_size"), config["linear_num_value_heads"]
    if inner is None or inner % value_heads or value_heads % config["linear_num_key_heads"]:
        raise UnsupportedGGUFError(
            f"ssm.inner_size {inner} is no whole number of value heads ({value_heads}), or the value heads no "
            f"whole number per key head ({config['linear_num_key_heads']})"
        )
    fields = {
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "linear_value_head_dim": inner // value_heads,
    }
    if mtp:
        fields["mtp_num_hidden_layers"] = mtp
    return fields


def qwen35moe_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's qwen35moe build: softmax over every expert, the top k always renormalized
    return moe_config(meta, config) | qwen35_config(meta, config)


@dataclass(frozen=True)
class Untile:
    """llama.cpp's order of a Gated DeltaNet's value heads undone (conversion/qwen.py,
    _LinearAttentionVReorderBase._reorder_v_heads). Hugging Face groups the value heads by the key head they
    share, [k0: v0 .. v(g-1), k1: ...]; the converter stores them tiled for ggml's broadcast, [v0 of k0, v0 of
    k1, ..., v1 of k0, ...], where there are fewer key heads than value heads. Along `axis` (0: rows, 1: columns),
    from `start` on, heads of `size` values."""

    start: int
    key_heads: int
    group: int  # value heads per key head
    size: int
    axis: int = 0

    def index(self, n: int) -> np.ndarray:
        """Hugging Face's [n] positions along the axis, as indices into the stored ones."""
        heads = self.key_heads * self.group * self.size
        if self.start + heads != n:
            raise UnsupportedGGUFError(
                f"{n} values along an axis, expected {self.start} + {heads} value heads'"
            )
        tiled = np.arange(heads).reshape(self.group, self.key_heads, self.size).transpose(1, 0, 2)
        return np.concatenate([np.arange(self.start), self.start + tiled.reshape(-1)])

    def in_blocks(self, block: int) -> "Untile | None":
        """The same order over blocks of `block` values along the axis, or None where a head splits a block."""
        if self.size % block or self.start % block:
            return None
        return Untile(self.start // block, self.key_heads, self.group, self.size // block, self.axis)


def key_head_groups(config: dict[str, Any], name: str) -> list[tuple[str, int, slice]]:
    """Qwen3-Next's tensors whose rows Hugging Face groups by key head, as (Qwen3.5's tensor, part, rows) pieces.
    ssm_ba (in_proj_ba) holds, for each key head, its g value heads' b rows, then their a rows; ssm_in
    (in_proj_qkvz) its q, k (key_head_dim rows each), then its value heads' v and z (g x value_head_dim each).
    Qwen3.5's tensors hold every key head's q, then every k, every v (value head j of key head h is head h * g + j),
    and z, b, a each alone: transformers' fix_query_key_value_ordering, llama.cpp's Qwen3NextModel.modify_tensors."""
    key_heads = config["linear_num_key_heads"]
    g = config["linear_num_value_heads"] // key_heads
    if name == "ssm_ba":
        layout = [("ssm_beta", g), ("ssm_alpha", g)]
    else:
        kd, vd = config["linear_key_head_dim"], g * config["linear_value_head_dim"]
        layout = [("attn_qkv", kd), ("attn_qkv", kd), ("attn_qkv", vd), ("attn_gate", vd)]
    width = sum(size for _, size in layout)  # a key head's rows
    targets, start = [], 0
    parts = {target: 0 for target, _ in layout}  # pieces so far of each tensor
    for target, size in layout:
        for head in range(key_heads):
            row = head * width + start
            targets.append((target, parts[target], slice(row, row + size)))
            parts[target] += 1
        start += size
    return targets


def value_heads_tiled(config: dict[str, Any]) -> bool:
    """Whether llama.cpp's converter stored a Qwen3.5 file's value heads tiled: where key heads are fewer."""
    return config["linear_num_key_heads"] < config["linear_num_value_heads"]


def value_head_order(config: dict[str, Any], name: str) -> Untile | None:
    """How a DeltaNet tensor's value heads are stored (None: as Hugging Face's): in_proj_qkv's v rows and the
    convolution's v channels after q and k, in_proj_z's rows, in_proj_b's and in_proj_a's, A_log and dt_bias (a
    value each), out_proj's columns. The converter reorders only where key heads are fewer than value heads."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if not value_heads_tiled(config):
        return None
    group, size = value_heads // key_heads, config["linear_value_head_dim"]
    after_qk = 2 * key_heads * config["linear_key_head_dim"]
    orders = {
        "attn_qkv": Untile(after_qk, key_heads, group, size),
        "ssm_conv1d": Untile(after_qk, key_heads, group, size),
        "attn_gate": Untile(0, key_heads, group, size),
        "ssm_out": Untile(0, key_heads, group, size, axis=1),
    }
    for name_per_head in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        orders[name_per_head] = Untile(0, key_heads, group, 1)
    return orders.get(name)


SILU = {"hidden_act": "silu"}
GELU_TANH = {"hidden_activation": "gelu_pytorch_tanh"}
LLAMA3_ROPE = ("rope_freqs",)
LONGROPE = ("rope_factors_long", "rope_factors_short")
LLAMA_BIASES = (BiasGroup("attention_bias", ATTENTION_BIASES), BiasGroup("mlp_bias", MLP_BIASES))
# a sparse layer's shape: `expert_feed_forward_length` is Qwen's; OLMoE's and Mixtral's experts are
# feed_forward_length wide (their converters write intermediate_size, the expert's, there)
EXPERT_KEYS = {
    "num_experts": ("expert_count", REQUIRED),
    "num_experts_per_tok": ("expert_used_count", REQUIRED),
}
# Mixtral's and Granite MoE's classes name the expert count num_local_experts
LOCAL_EXPERT_KEYS = {
    "num_local_experts": ("expert_count", REQUIRED),
    "num_experts_per_tok": ("expert_used_count", REQUIRED),
}
QWEN_MOE_KEYS = EXPERT_KEYS | {"moe_intermediate_size": ("expert_feed_forward_length", REQUIRED)}
QWEN35_KEYS = {
    "linear_conv_kernel_dim": ("ssm.conv_kernel", REQUIRED),
    "linear_key_head_dim": ("ssm.state_size", REQUIRED),
    "linear_num_key_heads": ("ssm.group_count", REQUIRED),
    "linear_num_value_heads": ("ssm.time_step_rank", REQUIRED),
}
QWEN35_IN_PLACE = (
    "ssm_a holds -exp(A_log), which no float32 log gives back bit for bit, and ssm_out's columns are in llama.cpp's "
    "order of value heads, which a K-quant's 256-value blocks cannot be reordered in"
)
# Qwen3.5-MoE's and Qwen3-Next's: a dense feed_forward_length where the converter writes one
QWEN35MOE_KEYS = (
    QWEN35_KEYS
    | QWEN_MOE_KEYS
    | {
        "intermediate_size": ("feed_forward_length", None),
        "shared_expert_intermediate_size": ("expert_shared_feed_forward_length", REQUIRED),
    }
)
QWEN3NEXT_IN_PLACE = "ssm_a holds -exp(A_log), which no float32 log gives back bit for bit"
# every layer sparse, as config.json spells it for Qwen's MoE classes
QWEN_ALL_SPARSE = {"use_sliding_window": False, "mlp_only_layers": [], "decoder_sparse_step": 1}

# what every hybrid row shares (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: conversion/qwen.py's Qwen3NextModel): +1 baked
# into every norm but DeltaNet's gated one, partial rotary, ssm_a and ssm_dt without a .weight suffix, the
# DeltaNet tensors by mixer
HYBRID_ROW = dict(
    norm_shift=1.0,
    partial_rotary=True,
    bare=("ssm_a", "ssm_dt"),
    mixer_tensors=QWEN35_MIXERS,
    unshifted=("ssm_norm",),
)

FAMILIES: dict[str, Family] = {
    # Llama 2/3.x, Mistral (llama.cpp writes MistralForCausalLM as `llama`), SmolLM2, DeepSeek-R1-Distill-Llama
    "llama": Family(
        "LlamaForCausalLM",
        "llama",
        LLAMA_LAYER,
        constants=SILU,
        biases=LLAMA_BIASES,
        permute_qk=True,
        rope_tensors=LLAMA3_ROPE,
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        "qwen2",
        LLAMA_LAYER,
        constants=SILU | {"use_sliding_window": False},
        biases=(BiasGroup(None, ("attn_q", "attn_k", "attn_v")),),
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        "qwen3",
        LLAMA_LAYER | QK_NORMS,
        constants=SILU | {"use_sliding_window": False},
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        "gemma2",
        GEMMA_LAYER,
        keys={  # llama.cpp's defaults: Gemma 2's
            "sliding_window": ("attention.sliding_window", 4096),
            "attn_logit_softcapping": ("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": ("final_logit_softcapping", 30.0),
        },
        constants=GELU_TANH,
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        norm_shift=1.0,
        extra=gemma2_config,
    ),
    "gemma3": Family(
        "Gemma3ForCausalLM",
        "gemma3_text",
        GEMMA_LAYER | QK_NORMS,
        # the local base is a key of its own, which llama.cpp defaults to 10000 (llama_hparams), not the global one
        keys={"rope_local_base_freq": ("rope.freq_base_swa", 10000.0)},
        constants=GELU_TANH,
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        norm_shift=1.0,
        extra=gemma3_config,
    ),
    "gemma4": Family(
        "Gemma4ForCausalLM",
        "gemma4_text",
        GEMMA4_LAYER,
        constants=GELU_TANH,
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        bare=GEMMA4_BARE,
        rope_tensors=("rope_freqs",),
        extra=gemma4_config,
        per_layer_keys=("attention.head_count_kv", "feed_forward_length"),
        global_tensors={
            "per_layer_token_embd": "model.embed_tokens_per_layer",
            "per_layer_model_proj": "model.per_layer_model_projection",
            "per_layer_proj_norm": "model.per_layer_projection_norm",
        },
        from_tensors=gemma4_from_tensors,
        absent=gemma4_absent,
        layer_dims=gemma4_layer_dims,
        dense_and_experts=True,
    ),
    "phi3": Family(
        "Phi3ForCausalLM",
        "phi3",
        PHI3_LAYER,
        constants=SILU,
        rope_tensors=LONGROPE,
        partial_rotary=True,
        linear_rope_scaling=False,  # Hugging Face's Phi3Config accepts only default and longrope
        extra=phi3_config,
    ),
    "olmo2": Family(
        "Olmo2ForCausalLM",
        "olmo2",
        OLMO2_LAYER,
        constants=SILU,
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        qk_norm_per_head=False,
        extra=olmo2_config,
    ),
    "granite": Family(
        "GraniteForCausalLM",
        "granite",
        LLAMA_LAYER,
        keys={"logits_scaling": ("logit_scale", REQUIRED)},
        constants=SILU,
        biases=LLAMA_BIASES,
        permute_qk=True,
        rope_tensors=LLAMA3_ROPE,
        extra=granite_config,
    ),
    "smollm3": Family(
        "SmolLM3ForCausalLM",
        "smollm3",
        LLAMA_LAYER,
        constants=SILU | {"use_sliding_window": False, "sliding_window": None},
        biases=LLAMA_BIASES,
        permute_qk=True,
        extra=smollm3_config,
    ),
    "qwen3moe": Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        SPARSE_LAYER | QK_NORMS | moe_layer(),
        keys=QWEN_MOE_KEYS,
        # llama.cpp's qwen3moe build always renormalizes the top k (Qwen3-30B-A3B's norm_topk_prob: true)
        constants=SILU | QWEN_ALL_SPARSE | {"norm_topk_prob": True},
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        extra=moe_config,
    ),
    "qwen2moe": Family(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        SPARSE_LAYER | moe_layer() | SHARED_EXPERT,
        keys=QWEN_MOE_KEYS,
        constants=SILU | QWEN_ALL_SPARSE,
        biases=(BiasGroup(None, ("attn_q", "attn_k", "attn_v")),),
        extra=qwen2moe_config,
    ),
    # pre-norm as Llama, q/k norms over the whole projection as OLMo 2; the top k never renormalized (llama.cpp's
    # olmoe build, OLMoE's norm_topk_prob: false)
    "olmoe": Family(
        "OlmoeForCausalLM",
        "olmoe",
        SPARSE_LAYER | QK_NORMS | moe_layer(),
        keys=EXPERT_KEYS,
        constants=SILU | {"norm_topk_prob": False},
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        qk_norm_per_head=False,
        extra=olmoe_config,
    ),
    # Llama's q/k row order and rope_freqs, as the granite build; experts feed_forward_length wide (the converter
    # writes Granite MoE's intermediate_size, the expert's, there)
    "gpt-oss": Family(
        "GptOssForCausalLM",
        "gpt_oss",
        GPT_OSS_LAYER,
        keys=LOCAL_EXPERT_KEYS,
        biases=(
            BiasGroup("attention_bias", ATTENTION_BIASES),
            BiasGroup(None, ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")),
        ),
        extra=gpt_oss_config,
        bare=("attn_sinks",),
        yarn_truncate=False,
        in_place_only="Hugging Face's GptOssForCausalLM stacks every expert's weights by column, which a GGUF's "
        "blocks cannot be written as",
    ),
    # Qwen3.5/3.6 dense (0.8B-27B): +1 baked into every norm but DeltaNet's gated one (Qwen3NextModel.
    # modify_tensors), value heads tiled, the MTP layers after the model's
    "qwen35": Family(
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        QWEN35_LAYER | {name: LLAMA_LAYER[name] for name in DENSE_FFN},
        keys=QWEN35_KEYS,
        constants=SILU,
        extra=qwen35_config,
        in_place_only=QWEN35_IN_PLACE,
        tiled_value_heads=True,
        **HYBRID_ROW,
    ),
    # Qwen3.5/3.6-MoE (35B-A3B, 122B-A10B): every FFN sparse with a shared expert; no dense feed_forward_length
    "qwen35moe": Family(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        QWEN35_LAYER | moe_layer() | SHARED_EXPERT,
        keys=QWEN35MOE_KEYS,
        constants=SILU,
        extra=qwen35moe_config,
        in_place_only=QWEN35_IN_PLACE,
        tiled_value_heads=True,
        **HYBRID_ROW,
    ),
    # Qwen3-Next (80B-A3B): Qwen3.5-MoE's, a release earlier; its value heads as Hugging Face's, ssm_ba grouped by
    # key head (GROUPED_BY_KEY_HEAD)
    "qwen3next": Family(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        QWEN35_LAYER | moe_layer() | SHARED_EXPERT,
        keys=QWEN35MOE_KEYS,
        # llama.cpp's build: every layer sparse (ffn_gate_inp required), the top k always renormalized
        constants=SILU | {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True},
        extra=qwen35moe_config,
        in_place_only=QWEN3NEXT_IN_PLACE,
        grouped_by_key_head=True,
        **HYBRID_ROW,
    ),
    "granitemoe": Family(
        "GraniteMoeForCausalLM",
        "granitemoe",
        SPARSE_LAYER | GRANITE_MOE_FFN,
        keys=LOCAL_EXPERT_KEYS | {"logits_scaling": ("logit_scale", REQUIRED)},
        constants=SILU,
        biases=(BiasGroup("attention_bias", ATTENTION_BIASES),),
        permute_qk=True,
        rope_tensors=LLAMA3_ROPE,
        extra=granitemoe_config,
    ),
}

# llama.cpp writes MixtralForCausalLM as `llama` with experts (`llama.expert_count` > 0, ffn_*_exps): always
# renormalized top k, q/k rows permuted as Llama's, no window (llama.cpp's llama build has none)
MIXTRAL = Family(
    "MixtralForCausalLM",
    "mixtral",
    SPARSE_LAYER | moe_layer("block_sparse_moe", ("w1", "w3", "w2")),
    keys=LOCAL_EXPERT_KEYS,
    constants=SILU | {"sliding_window": None},
    permute_qk=True,
    extra=moe_config,
)


def family_for(meta: dict[str, Any]) -> Family:
    """The family of a GGUF's `general.architecture` (Mixtral: `llama` with experts)."""
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedGGUFError(
            f"architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    if arch == "llama" and arch_key(meta, "expert_count", 0):
        return MIXTRAL
    return FAMILIES[arch]


def tensor_shapes(
    family: Family, config: dict[str, Any], layer: int | None = None
) -> dict[str, tuple[int, ...]]:
    """The shape of every GGUF tensor inside blk.N (numpy order: rows first) for this family and config (and
    layer, where a family's layers differ: Family.layer_dims)."""
    hidden = config["hidden_size"]
    head_dim, kv_heads, ffn = (
        config["head_dim"],
        config["num_key_value_heads"],
        config.get("intermediate_size", 0),
    )
    if family.layer_dims is not None and layer is not None:
        head_dim, kv_heads, ffn = family.layer_dims(config, layer)
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = kv_heads * head_dim
    shapes = {
        "attn_q": (q_rows, hidden),
        "attn_k": (kv_rows, hidden),
        "attn_v": (kv_rows, hidden),
        "attn_qkv": (q_rows + 2 * kv_rows, hidden),
        "attn_output": (hidden, q_rows),
        "attn_q_norm": (head_dim if family.qk_norm_per_head else q_rows,),
        "attn_k_norm": (head_dim if family.qk_norm_per_head else kv_rows,),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (2 * ffn if "ffn_gate" not in family.layer_tensors else ffn, hidden),
        "ffn_down": (hidden, ffn),
        "attn_sinks": (config["num_attention_heads"],),
    }
    if "ffn_gate_inp" in family.layer_tensors and ("num_experts" in config or "num_local_experts" in config):
        experts, size = expert_count(config), expert_size(config)
        shared = config.get("shared_expert_intermediate_size", 0)
        shapes |= {
            "ffn_gate_inp": (experts, hidden),
            "ffn_gate_exps": (experts, size, hidden),
            "ffn_up_exps": (experts, size, hidden),
            # some files fuse gate and up (as Granite MoE's Hugging Face tensor does): each expert's rows gate | up
            "ffn_gate_up_exps": (experts, 2 * size, hidden),
            "ffn_down_exps": (experts, hidden, size),
            "ffn_gate_shexp": (shared, hidden),
            "ffn_up_shexp": (shared, hidden),
            "ffn_down_shexp": (hidden, shared),
            "ffn_gate_inp_shexp": (1, hidden),
            "ffn_gate_inp.scale": (hidden,),  # Gemma 4's router's input scale, and each expert's output scale
            "ffn_down_exps.scale": (experts,),
            "pre_ffw_norm_2": (hidden,),
            "post_ffw_norm_1": (hidden,),
            "post_ffw_norm_2": (hidden,),
        }
    if size := config.get("hidden_size_per_layer_input"):  # Gemma 4's per-layer inputs
        shapes |= {"inp_gate": (size, hidden), "proj": (hidden, size)}
    if "layer_output_scale" in family.layer_tensors:
        shapes["layer_output_scale"] = (1,)
    if "ssm_out" in family.layer_tensors:  # Qwen3.5, Qwen3-Next: gated attention, Gated DeltaNet
        shapes |= {"attn_q": (2 * q_rows, hidden)} | deltanet_shapes(config)
    for name in family.layer_tensors:
        if name.endswith("norm") and name not in shapes:
            shapes[name] = (hidden,)
    return shapes


def deltanet_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet's tensors in Hugging Face's shapes (the GGUF's conv1d is [channels, taps], squeezed)."""
    hidden, value_heads = config["hidden_size"], config["linear_num_value_heads"]
    value_dim = value_heads * config["linear_value_head_dim"]
    conv_dim = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + value_dim
    return {
        "attn_qkv": (conv_dim, hidden),
        "attn_gate": (value_dim, hidden),
        "ssm_beta": (value_heads, hidden),
        "ssm_alpha": (value_heads, hidden),
        "ssm_conv1d": (conv_dim, 1, config["linear_conv_kernel_dim"]),
        "ssm_a": (value_heads,),
        "ssm_dt": (value_heads,),
        "ssm_norm": (config["linear_value_head_dim"],),
        "ssm_out": (hidden, value_dim),
        # Qwen3-Next's grouped projections (key_head_groups)
        "ssm_in": (conv_dim + value_dim, hidden),
        "ssm_ba": (2 * value_heads, hidden),
    }


def expert_count(config: dict[str, Any]) -> int:
    """Experts of a sparse layer, under the key each Hugging Face class reads in transformers 4.x and 5.x alike."""
    return config["num_local_experts"] if "num_local_experts" in config else config["num_experts"]


def expert_size(config: dict[str, Any]) -> int:
    """An expert's intermediate size: Qwen's moe_intermediate_size, else (OLMoE, Mixtral) intermediate_size."""
    return config.get("moe_intermediate_size") or config["intermediate_size"]


def attention_rows(config: dict[str, Any]) -> dict[str, int]:
    """Rows of q, k and v, in the order a fused attn_qkv stacks them."""
    head_dim = config["head_dim"]
    kv_rows = config["num_key_value_heads"] * head_dim
    return {"attn_q": config["num_attention_heads"] * head_dim, "attn_k": kv_rows, "attn_v": kv_rows}


def partial_rotary_factor(rope_dims: int, head_dim: int) -> float:
    """The factor Hugging Face turns back into rope_dims with int(head_dim * factor): rope_dims / head_dim, nudged up
    one float64 step where that product rounds below rope_dims (e.g. 40 / 48 * 48 = 39.99...)."""
    factor = rope_dims / head_dim
    while int(head_dim * factor) < rope_dims:
        factor = math.nextafter(factor, math.inf)
    return factor


# RoPE. llama.cpp keeps the base and a scaling type in metadata, and the llama3 and LongRoPE curves as tensors of
# per-frequency divisors; Hugging Face keeps all of it in config.json's rope_scaling.

# the largest relative error, against what llama.cpp rotates by, allowed for a recovered llama3 curve: a few
# float32 roundings (Hugging Face blends (1 - s) inv / factor + s inv, llama.cpp divides by 1 / ((1 - s) / factor + s))
LLAMA3_TOLERANCE = 2**-20
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_config(
    family: Family, meta: dict[str, Any], config: dict[str, Any], tensors: dict[str, np.ndarray]
) -> dict[str, Any]:
    """partial_rotary_factor and rope_scaling, from the metadata and the RoPE tensors (by name without .weight)."""
    head_dim, fields = config["head_dim"], {}
    rope_dims = arch_key(meta, "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        if not family.partial_rotary or not 0 < rope_dims < head_dim:
            raise UnsupportedGGUFError(f"partial rotary embedding ({rope_dims} of {head_dim})")
        fields["partial_rotary_factor"] = partial_rotary_factor(rope_dims, head_dim)
    kind = arch_key(meta, "rope.scaling.type")
    factor = arch_key(meta, "rope.scaling.factor") or arch_key(meta, "rope.scale_linear") or 1.0
    if kind == "yarn" and not tensors:
        fields["rope_scaling"] = yarn_scaling(meta, config, factor, family.yarn_truncate)
        return fields
    if kind not in (None, "none", "linear"):
        raise UnsupportedGGUFError(f"rope scaling {kind!r} is not supported")
    # llama.cpp reads an absent type as linear, and "none" as no scaling whatever the factor
    linear = kind != "none" and factor != 1.0
    if linear and (tensors or not family.linear_rope_scaling):
        raise UnsupportedGGUFError(
            f"linear rope scaling (factor {factor}) with {sorted(tensors) or family.model_type}"
        )
    if linear:
        fields["rope_scaling"] = {"rope_type": "linear", "factor": shortest_float(factor)}
    elif "rope_freqs" in tensors:
        orig = arch_key(meta, "rope.scaling.original_context_length")
        fields["rope_scaling"] = llama3_scaling(tensors["rope_freqs"], config["rope_theta"], rope_dims, orig)
    elif tensors:
        fields["rope_scaling"] = longrope_scaling(meta, config, tensors, rope_dims)
    return fields


def yarn_scaling(
    meta: dict[str, Any], config: dict[str, Any], factor: float, truncate: bool | None
) -> dict[str, Any]:
    """YaRN as Hugging Face's rope_scaling spells it, from llama.cpp's keys (its defaults where absent: betas 32
    and 1, the attention factor derived from the factor). `truncate` where the family's release says (GPT-OSS's
    false; llama.cpp rounds the band's ends, as transformers' default does)."""
    for key in ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor"):
        if arch_key(meta, f"rope.scaling.{key}") not in (None, 0.0, -1.0, 1.0):
            raise UnsupportedGGUFError(
                f"yarn with rope.scaling.{key} = {arch_key(meta, f'rope.scaling.{key}')}"
            )
    scaling = {
        "rope_type": "yarn",
        "factor": shortest_float(factor),
        "original_max_position_embeddings": arch_key(
            meta, "rope.scaling.original_context_length", config["max_position_embeddings"]
        ),
        "beta_fast": shortest_float(arch_key(meta, "rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": shortest_float(arch_key(meta, "rope.scaling.yarn_beta_slow", 1.0)),
    }
    if truncate is not None:
        scaling["truncate"] = truncate
    return scaling


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Hugging Face's llama3 frequencies (modeling_rope_utils._compute_llama3_parameters), in its float32 steps."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
    return torch.where(medium, blended, scaled)


def rope_inv_freq(base: float, dim: int) -> torch.Tensor:
    """The unscaled frequencies, computed as Hugging Face and llama.cpp's converter both do (float32)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_scaling(divisors: np.ndarray, base: float, dim: int, orig: int | None) -> dict[str, Any]:
    """The llama3 rope_scaling whose frequencies are llama.cpp's inv_freq / rope_freqs, to float32 rounding.

    The divisors fix the factor (the largest) and the two wavelengths bounding the blend, orig / low_freq_factor and
    orig / high_freq_factor, but not orig itself. Try Llama 3.1/3.2's low 1 / high 4 (with the file's original
    context length, else 8192) before fitting the bounds; a fit keeps the file's original context length, else
    takes the longer bound for it (low_freq_factor 1, as every Llama 3 has).
    """
    if divisors.shape != (dim // 2,):
        raise UnsupportedGGUFError(f"rope_freqs.weight has shape {divisors.shape}, expected ({dim // 2},)")
    inv_freq = rope_inv_freq(base, dim)
    target = inv_freq.double() / torch.from_numpy(divisors.astype(np.float64))
    factor = shortest_float(divisors.max())
    if not factor > 1.0:
        raise UnsupportedGGUFError("rope_freqs.weight divides no frequency: it is no llama3 rope scaling")
    defaults = LLAMA3_DEFAULTS
    candidates = [
        (
            defaults["low_freq_factor"],
            defaults["high_freq_factor"],
            orig or defaults["original_max_position_embeddings"],
        )
    ]
    if bounds := blend_bounds(
        divisors.astype(np.float64), factor, (inv_freq.double() / (2 * math.pi)).numpy()
    ):
        long, short = bounds  # wavelengths
        context = orig or max(1, round(long))
        # a fit from float32 divisors lands a few roundings off round numbers: try them first
        for spell in (lambda x: float(f"{x:.6g}"), shortest_float, float):
            candidates.append((spell(context / long), spell(context / short), context))
    best = math.inf
    for low, high, context in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": int(context)}  # fmt: skip
        error = ((llama3_inv_freq(inv_freq, scaling).double() - target).abs() / target).max().item()
        if error <= LLAMA3_TOLERANCE:
            return scaling
        best = min(best, error)
    raise UnsupportedGGUFError(
        f"rope_freqs.weight matches no llama3 rope scaling (closest: relative error {best:.1e})"
    )


def blend_bounds(divisors: np.ndarray, factor: float, u: np.ndarray) -> tuple[float, float] | None:
    """The wavelengths (long, short) = (orig / low_freq_factor, orig / high_freq_factor) that put each frequency,
    u = 1 / wavelength, in its band, or None.

    A frequency keeps its value where u > 1 / short, is divided by the factor where u < 1 / long, and between them
    is divided by 1 / ((1 - s) / factor + s), s = (u - 1 / long) / (1 / short - 1 / long): a line in u that two or
    more blended frequencies fix; one, or none, leaves it free within the gaps to the neighbouring bands.
    """
    kept = divisors <= 1 + LLAMA3_TOLERANCE
    divided = divisors >= factor * (1 - LLAMA3_TOLERANCE)
    blended = ~kept & ~divided
    smooth = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    low_bound = u[divided].max() if divided.any() else 0.0  # 1 / long lies above every divided u
    high_bound = u[kept].min() if kept.any() else math.inf  # and 1 / short below every kept u
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(u[blended], smooth[blended], 1)
        low = -intercept / slope
        high = low + 1 / slope
    elif blended.sum() == 1:
        (u1,), (s1,) = u[blended], smooth[blended]
        step = (u1 - low_bound) / 2
        if high_bound < math.inf:
            step = min(step, (high_bound - u1) * s1 / (1 - s1) / 2)
        low = u1 - step
        high = low + (u1 - low) / s1
    else:
        top = high_bound if high_bound < math.inf else 4 * low_bound
        low, high = low_bound + (top - low_bound) / 3, low_bound + 2 * (top - low_bound) / 3
    if not 0 < low < high:
        return None
    return 1 / low, 1 / high


def longrope_scaling(
    meta: dict[str, Any], config: dict[str, Any], tensors: dict[str, np.ndarray], rope_dims: int
) -> dict[str, Any]:
    """Phi-3's LongRoPE: the two factor lists, and the attention factor where the file's differs from the one
    Hugging Face derives from max_position_embeddings / original_max_position_embeddings."""
    if set(tensors) != set(LONGROPE):
        raise UnsupportedGGUFError(f"LongRoPE needs both of {LONGROPE}, the GGUF has {sorted(tensors)}")
    for name, values in tensors.items():
        if values.shape != (rope_dims // 2,):
            raise UnsupportedGGUFError(
                f"{name}.weight has shape {values.shape}, expected ({rope_dims // 2},)"
            )
    scaling = {
        "rope_type": "longrope",
        "long_factor": [shortest_float(v) for v in tensors["rope_factors_long"]],
        "short_factor": [shortest_float(v) for v in tensors["rope_factors_short"]],
    }
    orig = config["original_max_position_embeddings"]
    scale = config["max_position_embeddings"] / orig
    derived = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    stored = arch_key(meta, "rope.scaling.attn_factor", 1.0)
    if np.float32(stored) != np.float32(derived):
        scaling["attention_factor"] = shortest_float(stored)
    return scaling
