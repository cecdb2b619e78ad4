"""Tiny GGUFs written with gguf.GGUFWriter, with a trained vocabulary: a llama in any tensor type gguf can quantize
(write_tiny_gguf), and random transformers models of every supported family written the way llama.cpp's converter
writes them (write_llama_cpp_gguf)."""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import (
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    PoolingType,
    RopeScalingType,
    TokenType,
    get_tensor_name_map,
)
from gguf.quants import QuantError, quantize
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.helpers.tiny_models import cache_blocks

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "Prices rose 3.5% in 2024, from 1,200 to 1,242 units.",
    "Café, naïve, résumé: accents are letters too.",
    "Hello world! Hello there, world. Say hello to the world again and again.",
    "tokenizers split text into pieces, then merge the pieces that were seen most often.",
]

# Hugging Face tensor name -> GGUF name inside blk.N (the map llama.cpp's converter uses).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's HF-to-GGUF converter does to q and k: per head, rows (0, d/2), (1, d/2+1), ... side by side."""
    rows = weight.shape[0]
    split = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def tiny_weights(vocab_size: int, tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights of a 2-layer llama in Hugging Face names, layout and row order."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": normal(vocab_size, HIDDEN),
        "model.norm.weight": 1 + normal(HIDDEN),
    }
    if not tied:
        weights["lm_head.weight"] = normal(vocab_size, HIDDEN)
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "input_layernorm.weight": 1 + normal(HIDDEN),
            prefix + "post_attention_layernorm.weight": 1 + normal(HIDDEN),
            prefix + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            prefix + "mlp.gate_proj.weight": normal(FFN, HIDDEN),
            prefix + "mlp.up_proj.weight": normal(FFN, HIDDEN),
            prefix + "mlp.down_proj.weight": normal(HIDDEN, FFN),
        }
    return weights


def gguf_name(hf_name: str) -> str:
    name = hf_name.removesuffix(".weight")
    if name.startswith("model.layers."):
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{LAYER_NAMES[rest]}.weight"
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[
        name
    ] + ".weight"


def trained_bpe(
    pre_tokenizer, special_tokens: list[str], vocab_size: int = 400, **trainer_args
) -> tuple[list, list]:
    """(tokens in id order, merges as "left right") of a BPE trained on CORPUS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False, **trainer_args
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def byte_level_vocab(pre: str = "llama-bpe") -> dict:
    """GGUF tokenizer metadata of a byte-level BPE, as llama.cpp writes it: control tokens first, a user-defined
    token last, added tokens spelled as plain text."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokens, merges = trained_bpe(byte_level, specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokens.append("<tool>")
    types = [TokenType.CONTROL] * 2 + [TokenType.NORMAL] * (len(tokens) - 3) + [TokenType.USER_DEFINED]
    return dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges, bos=0, eos=1, add_bos=True)


def sentencepiece_vocab() -> dict:
    """GGUF tokenizer metadata of a SentencePiece BPE: <unk>, <s>, </s>, 256 byte tokens, then scored pieces."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    pieces, _ = trained_bpe(metaspace, [], vocab_size=300)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(pieces)
    # Pieces the trainer made later merge later: SentencePiece scores them lower.
    scores = [0.0] * 259 + [-float(index) for index in range(len(pieces))]
    return dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0)


def write_tiny_gguf(
    path: Path,
    vocab: dict,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    tied: bool = False,
    arch: str = "llama",
    raw: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF (q/k permuted as llama.cpp does, 2-D tensors in qtype, norms F32); returns the
    Hugging Face weights it holds. `raw` adds or replaces tensors, by GGUF name, written as they are."""
    weights = tiny_weights(len(vocab["tokens"]), tied)
    raw = raw or {}
    writer = GGUFWriter(path, arch)
    for key, value in [
        ("block_count", LAYERS),
        ("context_length", 256),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("rope.dimension_count", HEAD_DIM),
        ("vocab_size", len(vocab["tokens"])),
    ]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)

    add_vocab(writer, vocab)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    for name, value in raw.items():
        writer.add_tensor(name, value)
    for name, value in weights.items():
        if gguf_name(name) in raw:
            continue
        if name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        if value.ndim == 1:
            writer.add_tensor(gguf_name(name), value)
        else:
            data = quantize(value, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# Tiny random Hugging Face models of every family weights/gguf_arch.py supports, and GGUFs written from them the way
# llama.cpp's convert_hf_to_gguf.py writes them (conversion/base.py TextModel, llama.py, qwen.py, gemma.py, phi.py,
# olmo.py, granite.py; qwen.py's Qwen2MoeModel and Qwen3MoeModel, olmo.py's OlmoeModel and llama.py's LlamaModel for
# Mixtral, with their experts stacked, and granite.py's GraniteMoeModel, its stacked gate | up split in two): the same
# metadata calls, tensor names (gguf's TensorNameMap), q/k row order, Gemma's +1 on
# norms, generated RoPE tensors and tensor types. test_gguf_llama_cpp.py checks this writer against the real one.

PROMPT_LENGTH = 40  # longer than every sliding window below
# conversion classes that inherit LlamaModel's q/k permutation
LLAMA_LIKE = ("llama", "granite", "granitemoe", "smollm3")
GRANITE = ("granite", "granitemoe")  # GraniteModel's scalars, and no head_dim
GEMMA = ("gemma2", "gemma3")  # the converter adds 1 to every *norm.weight


@dataclass(frozen=True)
class TinyFamily:
    arch: str  # the GGUF architecture llama.cpp writes
    config_class: str  # transformers' classes
    model_class: str
    config: dict


TINY_FAMILIES = {
    # Llama 3.x rope scaling, with a blend wide enough to cover two frequencies of a 16-wide head
    "llama": TinyFamily("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 8.0, "original_max_position_embeddings": 2048})),
    "llama_biased": TinyFamily("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters={"rope_theta": 500000.0})),
    # llama.cpp writes MistralForCausalLM as `llama`; an explicit head_dim (Mistral-Nemo) and no window
    "mistral": TinyFamily("llama", "MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, sliding_window=None, tie_word_embeddings=False)),
    "qwen2": TinyFamily("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True, rope_parameters={"rope_theta": 1000000.0})),
    "qwen3": TinyFamily("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=False)),
    # query_pre_attn_scalar = head_dim: llama.cpp stores no attention scale for Gemma and uses 1/sqrt(head_dim)
    "gemma2": TinyFamily("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    # layers 0-4 and 6 slide, 5 is global (llama.cpp's hard-coded 5:1); Gemma 3 4B's linear 8 on global layers
    "gemma3": TinyFamily("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # LongRoPE past original_max_position_embeddings (the 40-token prompt uses the long factors), partial rotary
    "phi3": TinyFamily("phi3", "Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        original_max_position_embeddings=32, max_position_embeddings=128, sliding_window=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "long_factor": [1.0, 1.5, 2.25, 3.5, 5.0, 7.5],
                         "short_factor": [1.0, 1.05, 1.1, 1.2, 1.35, 1.5]})),
    "olmo2": TinyFamily("olmo2", "Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False)),
    "granite": TinyFamily("granite", "GraniteConfig", "GraniteForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.015625,
        residual_multiplier=0.22, logits_scaling=8.0)),
    # layer 3 has no RoPE (llama.cpp's hard-coded every 4th)
    "smollm3": TinyFamily("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True)),
    # Mixture-of-Experts: experts 32 wide (a Q8_0/Q4_0 block), top 2 of 8 or 4. Qwen3-30B-A3B's renormalized top k
    "qwen3moe": TinyFamily("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False)),
    # as many k/v heads as heads: llama.cpp's olmoe reads attn_k_norm as [hidden] (OLMoE-1B-7B's 16 and 16)
    "olmoe": TinyFamily("olmoe", "OlmoeConfig", "OlmoeForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    # a shared expert behind its sigmoid gate; the top k not renormalized (Qwen1.5-MoE's)
    "qwen2moe": TinyFamily("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        tie_word_embeddings=True)),
    # Granite's scalars around experts stacked in one Hugging Face tensor (gate | up per expert); attention biases
    "granitemoe": TinyFamily("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, attention_bias=True,
        embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0)),
    # llama.cpp writes MixtralForCausalLM as `llama` with experts; no window (its llama build has none)
    "mixtral": TinyFamily("llama", "MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False)),
}  # fmt: skip


def tiny_hf_model(family: "str | TinyFamily", vocab_size: int, seed: int = 0):
    """A random transformers model of the family (a TINY_FAMILIES name, or a spec), every parameter drawn at random
    (initialization leaves norms at 1 or 0 and biases at 0, which would hide a missing shift or bias), in eval
    mode."""
    import transformers

    spec = TINY_FAMILIES[family] if isinstance(family, str) else family
    config_class = getattr(transformers, spec.config_class)
    config = config_class(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=None, **spec.config
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and spec.arch in GEMMA:
                param.copy_(torch.randn_like(param) * 0.5)  # x * (1 + w): some 1 + w outside [0.5, 2]
            elif "norm" in name:
                param.copy_(1 + torch.randn_like(param) * 0.1)
            else:
                param.copy_(torch.randn_like(param) * 0.05)
    return model


def prompt_ids(vocab_size: int, length: int = PROMPT_LENGTH) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(1))


def served_logits(source, linear, kernels: bool) -> tuple[torch.Tensor, list]:
    """kvserve's float32 logits of prompt_ids (a prefill of 16, then one token at a time) from `source` (a GGUF
    read in place, or a folder) on `linear`, and each linear layer's bits (None: dense)."""
    from model.kv_cache import KVCache
    from model.linear import Linear
    from tests.helpers.tiny_models import CpuPath

    path = CpuPath(kernels)
    ours, config = path.load(source, linear=linear)
    ids = prompt_ids(config.vocab_size)[0].tolist()
    out = path.run(
        ours, KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu"), ids, 0, list(range(16))
    )
    return out, [getattr(m, "bits", None) for m in ours.modules() if isinstance(m, Linear)]


def reference_logits(model) -> torch.Tensor:
    """transformers' float32 logits of prompt_ids."""
    with torch.no_grad():
        return model(prompt_ids(model.config.vocab_size)).logits[0].float()


def llama3_rope_freqs(base: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for a llama3 rope scaling (LlamaModel.generate_extra_tensors): per frequency,
    1 above orig/high, the factor below orig/low, else the blend's divisor, in float32 as it computes them."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq  # a float32 tensor
        if wavelen < orig / high:
            divisors.append(torch.tensor(1.0))
        elif wavelen > orig / low:
            divisors.append(torch.tensor(float(factor)))
        else:
            smooth = (orig / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.stack(divisors).float().numpy()


def add_vocab(writer: GGUFWriter, vocab: dict) -> None:
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        writer.add_unk_token_id(vocab["unk"])
    if "add_bos" in vocab:
        writer.add_add_bos_token(vocab["add_bos"])


def add_llama_cpp_metadata(writer: GGUFWriter, arch: str, hparams: dict, ftype: LlamaFileType) -> None:
    """The metadata set_gguf_parameters writes for these families, from config.json as the converter reads it."""
    hparams = dict(hparams)
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    full = rope.get("full_attention", rope)
    hidden, heads = hparams["hidden_size"], hparams["num_attention_heads"]
    if arch in GRANITE:
        hparams.pop("head_dim", None)  # GraniteModel ignores head_dim
    if arch == "gemma2":  # Gemma2Model writes its own list, without a RoPE base
        writer.add_context_length(hparams["max_position_embeddings"])
        writer.add_embedding_length(hidden)
        writer.add_block_count(hparams["num_hidden_layers"])
        writer.add_feed_forward_length(hparams["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(hparams["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
        writer.add_file_type(ftype)
        writer.add_attn_logit_softcapping(hparams["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
        writer.add_sliding_window(hparams["sliding_window"])
        return
    if arch == "phi3":  # Phi3MiniModel too
        orig = hparams["original_max_position_embeddings"]
        writer.add_context_length(hparams["max_position_embeddings"])
        writer.add_rope_scaling_orig_ctx_len(orig)
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(hparams["intermediate_size"])
        writer.add_block_count(hparams["num_hidden_layers"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(hparams["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_file_type(ftype)
        writer.add_sliding_window(hparams.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = hparams["max_position_embeddings"] / orig
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            )
        return
    # TextModel.set_gguf_parameters
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hparams["num_key_value_heads"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if (head_dim := hparams.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)
    # TextModel's expert keys (num_local_experts first), and Qwen2MoeModel's (Qwen3MoeModel's too) sizes
    if (experts := hparams.get("num_local_experts", hparams.get("num_experts"))) is not None:
        writer.add_expert_count(experts)
    if (used := hparams.get("num_experts_per_tok")) is not None:
        writer.add_expert_used_count(used)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(hparams["moe_intermediate_size"])
        if (shared := hparams.get("shared_expert_intermediate_size")) is not None:
            writer.add_expert_shared_feed_forward_length(shared)
    if arch in LLAMA_LIKE:  # LlamaModel
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(hparams.get("head_dim") or hidden // heads)
    if arch in GRANITE:
        writer.add_attention_scale(hparams["attention_multiplier"])
        writer.add_embedding_scale(hparams["embedding_multiplier"])
        writer.add_residual_scale(hparams["residual_multiplier"])
        writer.add_logit_scale(hparams["logits_scaling"])
    if arch == "gemma3":  # Gemma3Model, after TextModel's
        writer.add_context_length(hparams["max_position_embeddings"])
        writer.add_head_count(heads)
        writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
        writer.add_rope_freq_base(full["rope_theta"])
        if hparams.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(hparams["final_logit_softcapping"])
        if hparams.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(hparams["sliding_window"])
        writer.add_head_count_kv(hparams["num_key_value_heads"])


# a Hugging Face checkpoint's per-expert tensor: (its module up to .experts, the expert, the kind: gate_proj, w1, ...)
EXPERT_TENSOR = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with each layer's experts stacked, in id order, into one [experts, rows, K] tensor per kind,
    named as llama.cpp's converters name it before mapping (`...mlp.experts.gate_proj.weight`: Qwen2MoeModel's and
    OlmoeModel's modify_tensors; Mixtral's w1/w3/w2 alike, which gguf's name map also knows)."""
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    tensors = {}
    for name, value in weights.items():
        if match := EXPERT_TENSOR.fullmatch(name):
            module, expert, kind = match.groups()
            stacked.setdefault(f"{module}.{kind}.weight", {})[int(expert)] = value
        else:
            tensors[name] = value
    for name, experts in stacked.items():
        tensors[name] = torch.stack([experts[e] for e in range(len(experts))])
    return tensors


def llama_cpp_tensors(
    arch: str,
    hparams: dict,
    weights: dict[str, torch.Tensor],
    fuse_qkv: bool = False,
    fuse_gate_up_exps: bool = False,
):
    """(GGUF name, float32 values) as modify_tensors and generate_extra_tensors give them."""
    heads, kv_heads = hparams["num_attention_heads"], hparams["num_key_value_heads"]
    arch_id = {name: key for key, name in MODEL_ARCH_NAMES.items()}[arch]
    names = get_tensor_name_map(arch_id, hparams["num_hidden_layers"])
    tensors = {}
    for name, value in stack_experts(weights).items():
        value = value.float().numpy()
        if arch == "granitemoe" and name.endswith("block_sparse_moe.input_linear.weight"):
            # GraniteMoeModel.modify_tensors: every expert's gate rows [experts, size, hidden], then its up rows
            layer = int(name.split(".")[2])
            gate, up = np.split(value, 2, axis=-2)
            tensors[TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_EXP].format(bid=layer) + ".weight"] = gate
            tensors[TENSOR_NAMES[MODEL_TENSOR.FFN_UP_EXP].format(bid=layer) + ".weight"] = up
            continue
        if arch == "gemma2" and name == "lm_head.weight":
            continue  # Gemma2Model drops it: llama.cpp ties Gemma 2
        if arch in LLAMA_LIKE and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = llama_cpp_permute(value, heads)
        elif arch in LLAMA_LIKE and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = llama_cpp_permute(value, kv_heads)
        if arch in GEMMA and name.endswith("norm.weight"):
            value = value + np.float32(1)
        gguf = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf is not None, name
        tensors[gguf] = value
    if fuse_qkv:  # --fuse-qkv: q, k, v (already permuted) stacked into attn_qkv, weights and biases alike
        for gguf in [n for n in tensors if ".attn_q." in n]:
            parts = [tensors.pop(gguf.replace(".attn_q.", f".attn_{p}.")) for p in "qkv"]
            tensors[gguf.replace(".attn_q.", ".attn_qkv.")] = np.concatenate(parts)
    if fuse_gate_up_exps:  # --fuse-gate-up-exps: each expert's gate rows, then its up rows
        for gguf in [n for n in tensors if ".ffn_gate_exps." in n]:
            parts = [tensors.pop(gguf), tensors.pop(gguf.replace("_gate_exps", "_up_exps"))]
            tensors[gguf.replace("_gate_exps", "_gate_up_exps")] = np.concatenate(parts, axis=1)
    rope = hparams.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        dim = hparams.get("head_dim") or hparams["hidden_size"] // heads
        tensors["rope_freqs.weight"] = llama3_rope_freqs(
            rope["rope_theta"], dim, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )  # fmt: skip
    if arch == "phi3" and rope.get("long_factor"):
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    return tensors


def write_llama_cpp_gguf(
    hf_dir: Path,
    path: Path,
    vocab: dict,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    fuse_qkv: bool = False,
    fuse_gate_up_exps: bool = False,
    pooling_type: int | None = None,
) -> dict[str, np.ndarray]:
    """Write the Hugging Face folder (config.json, model.safetensors) to GGUF as llama.cpp's converter does, tensors
    of two or more dimensions in qtype (F16 where a row does not fill whole blocks, as it falls back), norms and
    vectors in F32; returns the GGUF tensors it wrote, before quantization."""
    from safetensors.torch import load_file

    hparams = json.loads((hf_dir / "config.json").read_text())
    arch = TINY_ARCH_OF_CLASS[hparams["architectures"][0]]
    ftype = (
        LlamaFileType.ALL_F32 if qtype == GGMLQuantizationType.F32 else LlamaFileType[f"MOSTLY_{qtype.name}"]
    )
    writer = GGUFWriter(path, arch)
    add_llama_cpp_metadata(writer, arch, hparams, ftype)
    add_vocab(writer, vocab)
    if pooling_type is not None:  # an embedder's, as the converter writes it for Qwen3-Embedding (3: last)
        writer.add_pooling_type(PoolingType(pooling_type))
    weights = load_file(hf_dir / "model.safetensors")
    tensors = llama_cpp_tensors(arch, hparams, weights, fuse_qkv, fuse_gate_up_exps)
    for name, value in tensors.items():
        # routers (ffn_gate_inp, a shared expert's ffn_gate_inp_shexp) stay F32, as norms and vectors do
        f32 = value.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp" in name
        kind = GGMLQuantizationType.F32 if f32 else qtype
        try:
            data = quantize(value, kind)
        except QuantError:
            kind, data = GGMLQuantizationType.F16, quantize(value, GGMLQuantizationType.F16)
        writer.add_tensor(name, data, raw_dtype=kind if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors under its saved checkpoint's names: transformers 5 holds a MoE layer's experts stacked
    (mlp.experts.gate_up_proj) and saves them one per expert, as Hugging Face checkpoints have them."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return load_file(Path(folder) / "model.safetensors")


# transformers' class -> the GGUF architecture llama.cpp writes it as
TINY_ARCH_OF_CLASS = {family.model_class: family.arch for family in TINY_FAMILIES.values()}
