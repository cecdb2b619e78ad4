"""ModelConfig: read once from a Hugging Face `config.json`; what differs between families is model/families.py's
table plus the numbers each config carries (windows, RoPE per layer type, scalars)."""

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from model.families import FAMILIES, TEXT_MODEL_OF, Family

log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    pass


# a key's other spellings (transformers' attribute_map: Qwen3-MoE's hub configs say num_experts, the class itself
# num_local_experts), read as the one name the family table's defaults use
KEY_ALIASES = {"num_local_experts": "num_experts"}


@dataclass(frozen=True)
class Rope:
    """One set of rotary frequencies: theta, how many of a head's dims rotate, and the scaling applied."""

    theta: float
    dim: int  # rotary dims of a head: all of them but for partial rotary
    kind: str = "default"  # default | linear | llama3 | longrope | yarn | proportional
    scaling: tuple[tuple[str, float], ...] = ()  # the kind's parameters, sorted (key, value) pairs
    # longrope (Phi-3): per-frequency divisors for sequences that stay within the pretraining length, and for
    # those that may grow past it (one list per request: switching would change every cached key)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class LayerSpec:
    """What may differ from one layer to the next."""

    window: int | None = None  # keys further back than this are not attended (sliding-window layers)
    rope: Rope | None = None  # None: no rotary positions (NoPE layers, learned positions)
    # dense: the MLP | moe: sparse experts (ModelConfig.moe, model/moe.py) | dense_and_moe: both, side by side
    # (Gemma 4 26B-A4B)
    ffn: str = "dense"
    # attention: over the paged KV cache | linear_attention: Gated DeltaNet, a recurrent state per sequence
    # (ModelConfig.linear_attention, model/deltanet.py)
    mixer: str = "attention"
    # this layer's attention heads where they differ from the model's (Gemma 4's full-attention layers: wider heads,
    # fewer KV heads); 0: ModelConfig.head_dim, num_kv_heads
    head_dim: int = 0
    num_kv_heads: int = 0
    k_eq_v: bool = False  # the key projection's output is the values too (Gemma 4's full layers: no v_proj)
    # an earlier layer whose cached K/V this one reads, having none of its own (Gemma 4's last
    # num_kv_shared_layers: no k/v projections, nothing written); -1: its own
    kv_source: int = -1
    intermediate_size: int = (
        0  # this layer's MLP's where not the model's (Gemma 4's double-wide MLPs); 0: the model's
    )


@dataclass(frozen=True)
class MoeSpec:
    """The sparse layers' experts and router (../shared/MODELS.md §5.1)."""

    num_experts: int
    top_k: int  # experts each token takes
    intermediate_size: int  # each expert's
    renormalize: bool  # the top k weights divided by their sum
    shared_intermediate_size: int = 0  # a shared expert every token takes, behind a sigmoid gate (Qwen2-MoE)
    bias: bool = False  # the router and every expert's projections have biases (GPT-OSS)
    # Gemma 4: the router reads rms_norm(x) * a learned scale / sqrt(hidden), and each chosen expert's weight is
    # times its own learned scale
    scaled_router: bool = False


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers' shape (Qwen3.5, Qwen3-Next: ../shared/MODELS.md §5.3): per value head a
    key_head_dim x value_head_dim float32 state; q and k heads shared by groups of value heads; a causal
    depthwise convolution of conv_kernel taps over [q, k, v]. The value heads are grouped by the key head they
    read (value head h reads key head h // (value heads / key heads): Hugging Face's order) or tiled (h reads key
    head h % key heads), as llama.cpp's Qwen3.5 files store them: a GGUF is served in its own order, so that
    out_proj's K-quant blocks, 256 columns across two value heads, stay as they are."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    tiled_value_heads: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # [q, k, v] as the convolution sees them
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class KvGroup:
    """Attention layers whose K/V share one block table per sequence: layers of one window (None: full attention)
    and one head shape. Every group holds the same number of layers in a page (ModelConfig.kv_groups)."""

    window: int | None
    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    # layers side by side in a row of a page, where theirs are narrower than the widest layer's (Gemma 4 31B's full
    # layers: two of 4 x 512 in a row of 16 x 256)
    per_row: int = 1


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the Hugging Face architecture: a key of model/families.py's FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    layers: tuple[LayerSpec, ...]  # one per layer
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    # swiglu: down(silu(gate) up) | geglu: down(gelu_tanh(gate) up) | gelu: GPT-2's down(gelu(up)) |
    # clamped_swiglu: GPT-OSS's down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)), g = min(gate, limit)
    mlp: str = "swiglu"
    swiglu_alpha: float = 1.0  # clamped_swiglu's
    swiglu_limit: float = 0.0  # clamped_swiglu's
    positions: str = "rope"  # rope | learned
    block: str = "pre"  # where the norms sit: pre | sandwich | post (model/families.py)
    qk_norm: str = ""  # "" | head | proj
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's 1 + w)
    attention_scale: float = 0.0  # q k^T multiplier; 0 = 1/sqrt(head_dim)
    embedding_scale: float = 1.0  # Gemma sqrt(hidden), Granite's embedding_multiplier
    residual_scale: float = 1.0  # Granite: each branch times this before the residual add
    logits_scaling: float = 1.0  # Granite: logits divided by this
    attn_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    attn_sinks: bool = False  # GPT-OSS: a learned logit per head in each query's softmax, with no value
    v_norm: bool = False  # Gemma 4: the values RMS-normalised per head (no weight) before they are cached
    layer_scalar: bool = False  # Gemma 4: each block's output (the residual stream) times a loaded scalar
    # Gemma 4's per-layer embeddings (PLE): this many values of a token's own embedding table, and of a projection of
    # its embedding, for each layer, which the layer gates into its output (model/transformer.py); 0: none
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0  # the per-layer embeddings' rows (vocab_size_per_layer_input)
    final_softcap: float | None = None  # Gemma 2: cap * tanh(logits / cap)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # union of config.json and generation_config.json
    torch_dtype: str = "float32"  # the checkpoint's dtype
    moe: MoeSpec | None = None  # the experts of the layers whose ffn is "moe"
    linear_attention: LinearAttentionSpec | None = None  # the layers whose mixer is "linear_attention"
    attn_output_gate: bool = (
        False  # Qwen3.5: q_proj also gives a gate; attention's output times sigmoid(gate)
    )
    # False: the checkpoint is a backbone alone, with no LM head though untied (Qwen3-Embedding-8B's): it embeds,
    # and the loader lets the embedding stand in for the head only so that the model is whole; it never generates
    has_lm_head: bool = True

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def kv_shape(self, spec: LayerSpec) -> tuple[int, int]:
        """A layer's (KV heads, head dim)."""
        return spec.num_kv_heads or self.num_kv_heads, spec.head_dim or self.head_dim

    @property
    def kv_width(self) -> int:
        """The widest attention layer's K (or V) values a token: KV heads x head dim."""
        return max(
            (g.num_kv_heads * g.head_dim for g in self.kv_groups), default=self.num_kv_heads * self.head_dim
        )

    @property
    def uniform_kv(self) -> bool:
        """Every attention layer's K/V have the model's head shape (then the cache keeps each head's slots
        together: model/kv_cache.py)."""
        return all((g.num_kv_heads, g.head_dim) == (self.num_kv_heads, self.head_dim) for g in self.kv_groups)

    @property
    def kv_page_rows(self) -> int:
        """The rows of one page of the cache, each a block of tokens of one layer (or of per_row narrower ones side
        by side): the largest KV group's (0: no attention layer)."""
        return max((-(-len(group.layers) // group.per_row) for group in self.kv_groups), default=0)

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """Each KV group's window (None: full attention), in the order of a sequence's block tables."""
        return tuple(group.window for group in self.kv_groups) or (None,)

    @property
    def attention_layers(self) -> list[int]:
        """The layers that keep K/V in the paged cache (the others keep a state per sequence, or read an earlier
        layer's K/V)."""
        return [
            i for i, layer in enumerate(self.layers) if layer.mixer == "attention" and layer.kv_source < 0
        ]

    @property
    def kv_groups(self) -> tuple[KvGroup, ...]:
        """The attention layers in groups of one window and head shape each, as the KV cache pages them: a page
        holds a block of tokens of every layer of one group, and each group has its own block table per sequence,
        so a sliding-window layer's blocks can be freed once they leave its window while a full layer's stay
        (vLLM's hybrid allocator does the same). Groups fill as many rows of a page as the smallest kind's layers
        do: Gemma 3 270M's 3 full and 15 sliding layers make 1 + 5 groups of 3; a kind that does not divide leaves
        part of its last group's pages unused (Gemma 3 1B's 4 and 22: one group of 2 in 4 places). A page's rows
        are as wide as the widest layer's K/V; a kind whose width divides it puts that many layers side by side in
        a row (Gemma 4 31B: its 10 full layers, 4 KV heads of 512, two to a row of the sliding layers' 16 of 256,
        make 1 group in 5 rows, and its 50 sliding layers 10 groups of 5). Full attention first."""
        kinds: dict[tuple[int | None, int, int], list[int]] = {}
        for i in self.attention_layers:
            kinds.setdefault((self.layers[i].window, *self.kv_shape(self.layers[i])), []).append(i)
        if not kinds:
            return ()
        width = max(heads * dim for _, heads, dim in kinds)
        per_row = {
            kind: width // (kind[1] * kind[2]) if width % (kind[1] * kind[2]) == 0 else 1 for kind in kinds
        }
        rows = min(-(-len(layers) // per_row[kind]) for kind, layers in kinds.items())
        order = sorted(kinds, key=lambda kind: (-1 if kind[0] is None else kind[0], kind[1:]))
        return tuple(
            KvGroup(kind[0], tuple(kinds[kind][j : j + rows * per_row[kind]]), *kind[1:], per_row[kind])
            for kind in order
            for j in range(0, len(kinds[kind]), rows * per_row[kind])
        )

    @property
    def kv_rows(self) -> dict[int, tuple[int, int]]:
        """Each attention layer's (KV group, its row in that group's pages); a layer that reads another's K/V,
        that layer's. (Its place in the row: kv_place.)"""
        return {i: place[:2] for i, place in self.kv_places.items()}

    @property
    def kv_places(self) -> dict[int, tuple[int, int, int]]:
        """Each attention layer's (KV group, row, place in the row among the group's per_row); a layer that reads
        another's K/V, that layer's."""
        places = {
            i: (g, j // group.per_row, j % group.per_row)
            for g, group in enumerate(self.kv_groups)
            for j, i in enumerate(group.layers)
        }
        return places | {
            i: places[spec.kv_source] for i, spec in enumerate(self.layers) if spec.kv_source >= 0
        }

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.mixer == "linear_attention"]

    @property
    def longrope_original_len(self) -> int | None:
        """LongRoPE's pretraining length, if a layer uses LongRoPE: a sequence that may grow past it takes the
        long factors from its first token on (ModelRunner says which per token)."""
        ropes = [
            layer.rope for layer in self.layers if layer.rope is not None and layer.rope.kind == "longrope"
        ]
        return int(dict(ropes[0].scaling)["original_max_position_embeddings"]) if ropes else None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_dict(cfg, gen)

    @classmethod
    def from_dict(cls, cfg: dict, generation_config: dict | None = None) -> "ModelConfig":
        cfg = text_model_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "<none>")
            raise UnsupportedModelError(
                f"unsupported architecture {name!r}; kvserve supports {', '.join(sorted(FAMILIES))}"
            )
        family = FAMILIES[arch]
        cfg = {KEY_ALIASES.get(key, key): value for key, value in cfg.items()}
        defaults = family.config_defaults
        if "rope_theta" in cfg or "rope_scaling" in cfg:  # 4.x's spelling: 5.x's default would override it
            defaults = {k: v for k, v in defaults.items() if k != "rope_parameters"}
        cfg = defaults | cfg  # a key the config leaves out reads as transformers' class default
        eos = _as_ids(cfg.get("eos_token_id")) + _as_ids((generation_config or {}).get("eos_token_id"))
        common = dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(sorted(set(eos))),
            tie_word_embeddings=cfg["tie_word_embeddings"],
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )
        if family.layer_norm:  # GPT-2
            hidden, heads = cfg["n_embd"], cfg["n_head"]
            return cls(
                **common,
                hidden_size=hidden,
                num_layers=cfg["n_layer"],
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=cfg["n_positions"],
                norm_eps=cfg["layer_norm_epsilon"],
                layers=(LayerSpec(),) * cfg["n_layer"],
                norm="layernorm",
                mlp="gelu",
                positions="learned",
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
            )
        hidden, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or hidden // heads
        kinds = layer_types(cfg, family, n)
        # layer -> (head dim, KV heads, keys as values, KV source, MLP size) where not the model's (Gemma 4's)
        own_heads = gemma4_layers(cfg, kinds) if family.gemma4 else {}
        full_dim = next((d for i, (d, *_) in own_heads.items() if kinds[i] == "full_attention"), head_dim)
        ropes = rope_by_layer_type(cfg, head_dim, full_dim)
        nope = [i for i, uses_rope in enumerate(cfg.get("no_rope_layers") or [1] * n) if not uses_rope]
        window = cfg.get("sliding_window")
        moe, sparse = moe_spec(cfg, family), sparse_layers(cfg, family, n)
        linear = "linear_attention"
        layers = tuple(
            LayerSpec(
                window if kind == "sliding_attention" else None,
                None if i in nope or kind == linear else ropes[kind],
                ("dense_and_moe" if family.gemma4 else "moe") if i in sparse else "dense",
                linear if kind == linear else "attention",
                *own_heads.get(i, ()),
            )
            for i, kind in enumerate(kinds)
        )
        bias = bool(cfg.get("attention_bias", False))
        per_layer_size = (cfg.get("hidden_size_per_layer_input") or 0) if family.gemma4 else 0
        if per_layer_size and cfg["vocab_size_per_layer_input"] < cfg["vocab_size"]:
            raise UnsupportedModelError(
                "per-layer embeddings for fewer tokens than the vocabulary are not served"
            )
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            **common,
            hidden_size=hidden,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            # an all-sparse family's configs may have no dense size (Qwen3.5-MoE's): the experts' then, unused
            intermediate_size=cfg.get("intermediate_size") or cfg["moe_intermediate_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            norm_eps=cfg["rms_norm_eps"],
            layers=layers,
            mlp=family.mlp or mlp_kind(cfg),
            swiglu_alpha=cfg.get("swiglu_alpha", 1.0),
            swiglu_limit=cfg.get("swiglu_limit", 0.0),
            block=family.block,
            qk_norm=family.qk_norm,
            qkv_bias=family.qkv_bias or bias,
            o_bias=bias and not family.qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            norm_offset=family.norm_offset,
            # Gemma 4: 1, its q/k norms scale
            attention_scale=1.0
            if family.gemma4
            else scalar**-0.5
            if scalar
            else cfg.get("attention_multiplier", 0.0),
            embedding_scale=math.sqrt(hidden)
            if family.embedding_scale_sqrt_hidden
            else cfg.get("embedding_multiplier", 1.0),
            residual_scale=cfg.get("residual_multiplier", 1.0),
            logits_scaling=cfg.get("logits_scaling", 1.0),
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            attn_sinks=family.attn_sinks,
            moe=moe,
            linear_attention=linear_attention_spec(cfg) if linear in kinds else None,
            attn_output_gate=family.attn_output_gate,
            v_norm=family.gemma4,
            layer_scalar=family.gemma4,
            per_layer_input_size=per_layer_size,
            per_layer_vocab_size=cfg["vocab_size_per_layer_input"] if per_layer_size else 0,
        )


def gemma4_layers(cfg: dict, kinds: list[str]) -> dict[int, tuple[int, int, bool, int, int]]:
    """Gemma 4's layers that differ from the model's: (head dim, KV heads, keys as values, KV source, MLP size),
    LayerSpec's fields. Its full-attention layers' heads as transformers' Gemma4TextConfig reads them:
    per_layer_config where the config has it (what save_pretrained writes), else global_head_dim (512) and, where
    attention_k_eq_v, num_global_key_value_heads (the hub's configs). Its last num_kv_shared_layers read the cache
    of the last earlier layer of their kind (E2B, E4B), with MLPs twice as wide where use_double_wide_mlp. What
    kvserve does not serve yet is refused by name."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(
            "bidirectional attention (use_bidirectional_attention='all') is not served"
        )
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    if "per_layer_config" in cfg:
        overrides = {int(i): o for i, o in cfg["per_layer_config"].items()}
    else:
        override = {"head_dim": cfg.get("global_head_dim", 512)}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            override["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: override for i, kind in enumerate(kinds) if kind == "full_attention"}
    n = len(kinds)
    first_shared = n - (cfg.get("num_kv_shared_layers") or 0)
    layers = {}
    for i, kind in enumerate(kinds):
        o = overrides.get(i, {})
        kv = o.get("num_key_value_heads") or cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        source, size = -1, 0
        if i >= first_shared:
            source = max((j for j in range(first_shared) if kinds[j] == kind), default=-1)
            if source < 0:
                raise UnsupportedModelError(f"layer {i} shares the KV cache of no earlier {kind} layer")
            size = cfg["intermediate_size"] * 2 if cfg.get("use_double_wide_mlp") else 0
        layers[i] = (
            o.get("head_dim") or cfg["head_dim"],
            kv,
            k_eq_v and kind == "full_attention",
            source,
            size,
        )
    return layers


def linear_attention_spec(cfg: dict) -> LinearAttentionSpec:
    return LinearAttentionSpec(
        num_key_heads=cfg["linear_num_key_heads"],
        num_value_heads=cfg["linear_num_value_heads"],
        key_head_dim=cfg["linear_key_head_dim"],
        value_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg["linear_conv_kernel_dim"],
        tiled_value_heads=cfg.get("linear_value_heads_tiled", False),
    )


def text_model_config(cfg: dict) -> dict:
    """A multimodal checkpoint's config as its text model's (TEXT_MODEL_OF): text_config's keys over the top
    level's (which hold the ids of its special tokens), as that family's; but tie_word_embeddings the top level's
    where it has one, as transformers ties the whole model's head by its own config."""
    archs = cfg.get("architectures") or []
    text = next((TEXT_MODEL_OF[a] for a in archs if a in TEXT_MODEL_OF), None)
    if text is None or "text_config" not in cfg:
        return cfg
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "audio_config")}
    tied = {"tie_word_embeddings": top["tie_word_embeddings"]} if "tie_word_embeddings" in top else {}
    return top | cfg["text_config"] | tied | {"architectures": [text]}


def moe_spec(cfg: dict, family: Family) -> MoeSpec | None:
    """The experts of a MoE family's sparse layers; None for a dense family. The expert's size is
    moe_intermediate_size where dense layers keep intermediate_size (Qwen). Gemma 4's, where enable_moe_block:
    top_k_experts of num_experts, renormalized, its router scaled."""
    if family.gemma4 and cfg.get("enable_moe_block"):
        return MoeSpec(
            num_experts=cfg["num_experts"],
            top_k=cfg["top_k_experts"],
            intermediate_size=cfg["moe_intermediate_size"],
            renormalize=True,
            scaled_router=True,
        )
    if family.moe is None:
        return None
    if (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        raise UnsupportedModelError(
            "GPT-OSS's MXFP4 safetensors are not read yet: serve the model dequantized to bfloat16 (transformers' "
            "Mxfp4Config(dequantize=True)) or, once supported, its MXFP4_MOE GGUF"
        )
    if cfg.get("clip_qkv") is not None:  # OLMoE's option (off in the released models)
        raise UnsupportedModelError(f"unsupported clip_qkv={cfg['clip_qkv']!r}: kvserve does not clip q/k/v")
    renormalize = family.moe.renormalize
    shared = cfg.get("shared_expert_intermediate_size", 0) if family.moe.shared_expert else 0
    return MoeSpec(
        num_experts=cfg["num_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        renormalize=bool(cfg.get("norm_topk_prob", False)) if renormalize is None else renormalize,
        shared_intermediate_size=shared,
        bias=family.moe.bias,
    )


def sparse_layers(cfg: dict, family: Family, n: int) -> set[int]:
    """The layers whose FFN is sparse experts: all of a MoE family's, but for Qwen's dense ones (those listed in
    mlp_only_layers, and all but every decoder_sparse_step-th); every layer of a Gemma 4 with enable_moe_block."""
    if family.gemma4:
        return set(range(n)) if cfg.get("enable_moe_block") else set()
    if family.moe is None:
        return set()
    if family.moe.layers == "all":
        return set(range(n))
    dense, step = set(cfg.get("mlp_only_layers") or []), cfg.get("decoder_sparse_step") or 1
    return {i for i in range(n) if i not in dense and (i + 1) % step == 0}


def mlp_kind(cfg: dict) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    kinds = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}
    if act not in kinds:
        raise UnsupportedModelError(f"unsupported activation {act!r}; kvserve supports {', '.join(kinds)}")
    return kinds[act]


def layer_types(cfg: dict, family: Family, n: int) -> list[str]:
    """Each layer's mixer: "full_attention", "sliding_attention", or (a hybrid family's) "linear_attention"."""
    full, sliding = "full_attention", "sliding_attention"
    known = {full, sliding, "linear_attention"} if family.linear_attention else {full, sliding}
    if cfg.get("layer_types"):
        kinds = list(cfg["layer_types"])
        if unknown := set(kinds) - known:
            raise UnsupportedModelError(
                f"unsupported layer types {sorted(unknown)} (only {', '.join(sorted(known))})"
            )
    elif family.linear_attention:  # every full_attention_interval-th layer attention, the rest DeltaNet
        # (4: transformers' default, Qwen3NextConfig's and Qwen3_5TextConfig's)
        every = cfg.get("full_attention_interval") or 4
        kinds = [full if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    elif isinstance(family.window_layers, int):  # Gemma: every N-th layer full, the rest sliding
        every = cfg.get("sliding_window_pattern") or family.window_layers
        kinds = [full if (i + 1) % every == 0 else sliding for i in range(n)]
    elif family.window_layers == "all":
        kinds = [sliding] * n
    elif family.window_layers == "qwen" and cfg.get("use_sliding_window"):
        kinds = [sliding if i >= cfg.get("max_window_layers", n) else full for i in range(n)]
    else:
        kinds = [full] * n
    if len(kinds) != n:
        raise UnsupportedModelError(f"layer_types lists {len(kinds)} layers, the model has {n}")
    if family.gemma4:  # as Gemma4TextConfig forces it, whatever layer_types say
        kinds[-1] = full
    if not cfg.get("sliding_window"):  # a sliding layer without a window attends to everything
        kinds = [full if kind == sliding else kind for kind in kinds]
    return kinds


def rope_by_layer_type(cfg: dict, head_dim: int, full_dim: int | None = None) -> dict[str, Rope]:
    """The Rope of each layer type, from transformers 5's `rope_parameters` (one dict, or one per layer type) or
    4.x's `rope_theta` / `rope_scaling` (with Gemma 3's `rope_local_base_freq` for sliding layers). full_dim: the
    full-attention layers' head dim, where theirs is not head_dim (Gemma 4's)."""
    params = cfg.get("rope_parameters")
    if params and all(isinstance(v, dict) for v in params.values()):
        per_type = params
    else:
        flat = dict(params or cfg.get("rope_scaling") or {})
        if "rope_theta" not in flat:  # (GPT-OSS's class default has it only inside rope_parameters)
            flat["rope_theta"] = cfg["rope_theta"]
        per_type = {"full_attention": flat, "sliding_attention": flat}
        if "rope_local_base_freq" in cfg:
            per_type["sliding_attention"] = {"rope_theta": cfg["rope_local_base_freq"]}
    dims = {"full_attention": full_dim or head_dim}
    ropes = {kind: rope(p, dims.get(kind, head_dim), cfg) for kind, p in per_type.items()}
    ropes.setdefault("sliding_attention", ropes["full_attention"])
    return ropes


def rope(params: dict, head_dim: int, cfg: dict) -> Rope:
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first configs
    keys = {
        "default": (),
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "longrope": (),
        "yarn": (),
        "proportional": ("factor", "partial_rotary_factor"),
    }
    if kind not in keys:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {kind!r}; kvserve supports {', '.join(keys)}"
        )
    dim = int(head_dim * params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    theta = float(params["rope_theta"] if "rope_theta" in params else cfg["rope_theta"])
    if (
        kind == "proportional"
    ):  # Gemma 4: the whole head's pairs, only the first partial_rotary_factor turning
        defaults = {"factor": 1.0, "partial_rotary_factor": 1.0}
        return Rope(
            theta, head_dim, kind, tuple(sorted((k, float(params.get(k, v))) for k, v in defaults.items()))
        )
    scaling = tuple(sorted((k, float(params[k])) for k in keys[kind]))
    if kind == "yarn":
        return yarn(params, dim, theta, cfg)
    if kind != "longrope":
        return Rope(theta, dim, kind, scaling)
    # as transformers' _compute_longrope_parameters: cos and sin scaled by attention_factor, which defaults to
    # sqrt(1 + ln(factor) / ln(original)), factor defaulting to max_position_embeddings / original
    original = params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    scaling = (("attention_factor", float(attention)), ("original_max_position_embeddings", float(original)))
    short, long = (tuple(float(f) for f in params[k]) for k in ("short_factor", "long_factor"))
    if len(short) != dim // 2 or len(long) != dim // 2:
        raise UnsupportedModelError(
            f"longrope factor lists of {len(short)} and {len(long)}, expected {dim // 2}"
        )
    return Rope(theta, dim, kind, scaling, short, long)


def yarn(params: dict, dim: int, theta: float, cfg: dict) -> Rope:
    """YaRN (GPT-OSS, Qwen3's long context) as transformers' _compute_yarn_parameters: frequencies between the
    dims that turn beta_fast and beta_slow times over the pretraining length keep a blend of the original and the
    divided-by-factor ones, and cos and sin are scaled by attention_factor (0.1 ln(factor) + 1 by default)."""
    original = params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:

        def mscale(scale: float, m: float = 1.0) -> float:
            return 0.1 * m * math.log(scale) + 1.0 if scale > 1 else 1.0

        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    scaling = {
        "attention_factor": float(attention),
        "factor": float(factor),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "original_max_position_embeddings": float(original),
        "truncate": float(params.get("truncate", True)),
    }
    return Rope(theta, dim, "yarn", tuple(sorted(scaling.items())))


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
