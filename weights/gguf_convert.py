"""Convert a llama-family GGUF file into the Hugging Face folder layout kvserve loads.

The folder gets config.json, generation_config.json, tokenizer.json, tokenizer_config.json (weights/
gguf_tokenizer.py), and the weights under Hugging Face tensor names and row order:
- quantized/model.safetensors: the GGUF's Q4_0, Q4_1 and Q8_0 tensors as they are (exact integers and
  float32 scales, see QUANTIZED_FORMAT), every other tensor dequantized. kvserve serves it on CPU.
- model.safetensors (unless dense=False): every tensor dequantized, for the dequantized path and transformers.
Anything the converter cannot reproduce faithfully raises UnsupportedGGUFError naming it, rather than writing a
subtly wrong model.
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from weights.gguf_tokenizer import UnsupportedGGUFError, build_tokenizer, required

# in a sub-folder, so that tools reading every top-level *.safetensors of the folder (llama.cpp's converter,
# vLLM) never meet it
QUANTIZED_FILE = "quantized/model.safetensors"
# How quantized/model.safetensors stores a quantized weight W [N, K] (groups of 32 along K), read by
# model/quant.py: "W.q4" uint8 [N, K / 2] (q[2i] | q[2i + 1] << 4, w = scale * q + min), "W.q8" int8 [N, K]
# (w = scale * q), "W.scale" and "W.min" float16 [N, K / 32]. Dense tensors keep their plain name.
QUANTIZED_FORMAT = "kvserve-quantized-1"
KEPT_QUANTIZED = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)

# GGUF tensor name (inside blk.N) -> Hugging Face name (inside model.layers.N).
LAYER_TENSORS = {
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
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def convert_gguf(src: Path, dst: Path, progress: bool = True, dense: bool = True) -> None:
    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUFError(f"{src}: architecture {arch!r} is not supported (only 'llama')")
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = model_config(meta, gguf_tensors)
    # The tokenizer is cheap to build, so an unsupported one fails before the slow part.
    tokenizer, tokenizer_config = build_tokenizer(meta)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]

    tensors, quantized = convert_tensors(gguf_tensors, config, progress, dense)
    # the dtype that holds every dequantized value bit for bit (the quantized file's dense tensors are float32)
    dtype = faithful_dtype(list(tensors.values())) if dense else torch.float32
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    dst.mkdir(parents=True, exist_ok=True)
    files = {QUANTIZED_FILE: (quantized, {"format": QUANTIZED_FORMAT})}
    if dense:
        files["model.safetensors"] = ({name: t.to(dtype) for name, t in tensors.items()}, {"format": "pt"})
    for file, (contents, metadata) in files.items():
        (dst / file).parent.mkdir(exist_ok=True)
        save_file(contents, dst / file, metadata)
        # safetensors creates the file owner-only (0600); a server running as another user must still read it.
        (dst / file).chmod(0o644)
    tokenizer.save(str(dst / "tokenizer.json"))
    write_json(dst / "tokenizer_config.json", tokenizer_config)
    write_json(dst / "config.json", config)
    special_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    write_json(dst / "generation_config.json", special_ids)


def model_config(meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    hidden = required(meta, "llama.embedding_length")
    num_heads = required(meta, "llama.attention.head_count")
    head_dim = meta.get("llama.attention.key_length", hidden // num_heads)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedGGUFError(
            f"partial rotary embedding ({meta['llama.rope.dimension_count']} of {head_dim})"
        )
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise UnsupportedGGUFError(f"rope scaling ({scaling!r}, or llama3 rope_freqs) is not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": required(meta, "llama.feed_forward_length"),
        "num_hidden_layers": required(meta, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shortest_float(required(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": shortest_float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": required(meta, "llama.context_length"),
        # GGUF shapes list the row length first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[name] = token_id
    return config


def shortest_float(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.999999747e-06. Write the shortest decimal of the same float32."""
    return float(str(np.float32(value)))


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q_rows, hidden),
            prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_rows),
            prefix + "mlp.gate_proj.weight": (ffn, hidden),
            prefix + "mlp.up_proj.weight": (ffn, hidden),
            prefix + "mlp.down_proj.weight": (hidden, ffn),
        }
    return shapes


def convert_tensors(
    gguf_tensors: dict[str, ReaderTensor], config: dict[str, Any], progress: bool, dense: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the dequantized tensors, or {} without dense; quantized/model.safetensors' tensors)."""
    shapes = expected_shapes(config)
    tensors, quantized, seen = {}, {}, set()
    for tensor in tqdm(
        gguf_tensors.values(), desc="Converting GGUF tensors", unit="tensor", disable=not progress
    ):
        name = hf_name(tensor.name)
        seen.add(name)
        # GGUF lists dimensions fastest-varying first (ne[0] is the row length); numpy lists them the other way.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if name not in shapes or shape != shapes[name]:
            raise UnsupportedGGUFError(
                f"tensor {tensor.name} ({name}): shape {shape}, expected {shapes.get(name)}"
            )
        rows = np.arange(shape[0])
        if name.endswith("q_proj.weight"):
            rows = unpermute_rows(rows, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            rows = unpermute_rows(rows, config["num_key_value_heads"])
        if tensor.tensor_type in KEPT_QUANTIZED:
            parts = quantized_parts(tensor, shape)
            quantized |= {f"{name}.{part}": torch.from_numpy(values[rows]) for part, values in parts.items()}
        if dense or tensor.tensor_type not in KEPT_QUANTIZED:
            values = torch.from_numpy(dequantize_tensor(tensor)[rows])
            if dense:
                tensors[name] = values
            if tensor.tensor_type not in KEPT_QUANTIZED:
                quantized[name] = values
    if missing := sorted(shapes.keys() - seen):
        raise UnsupportedGGUFError(f"GGUF lacks tensors for {missing[:5]} ({len(missing)} missing)")
    return tensors, quantized


def quantized_parts(tensor: ReaderTensor, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """A Q4_0 / Q4_1 / Q8_0 tensor's blocks as QUANTIZED_FORMAT's parts (exact: no value is recomputed)."""
    N, K = shape
    blocks = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(N, K // 32, -1)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if tensor.tensor_type == GGMLQuantizationType.Q8_0:
        return {"q8": blocks[..., 2:34].copy().view(np.int8).reshape(N, K), "scale": scale}
    if tensor.tensor_type == GGMLQuantizationType.Q4_1:
        low, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:20]
    else:  # Q4_0: w = d (q - 8) = d q + (-8 d), and -8 d is exact in float16 unless it overflows
        low, qs = (-8 * scale.astype(np.float32)).astype(np.float16), blocks[..., 2:18]
    # a block's 16 bytes hold its values 0..15 in their low nibbles and 16..31 in their high nibbles
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(N, K)
    return {"q4": q[:, 0::2] | (q[:, 1::2] << 4), "scale": scale, "min": low}


def hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")
    parts = base.split(".")
    if kind == "weight" and base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.weight"
    if kind == "weight" and len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.weight"
    raise UnsupportedGGUFError(
        f"tensor {gguf_name!r} has no Llama counterpart (biases and experts are not supported)"
    )


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor in float32, shaped as numpy lists dimensions."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedGGUFError(
            f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized"
        ) from None
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # F32 tensors come back as a read-only view of the memory-mapped file; torch wants writable memory.
    return np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]).reshape(shape)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order, giving back Hugging Face's.

    Hugging Face's rotary code pairs row r of a head with row r + head_dim/2 (rotate_half); llama.cpp pairs adjacent
    rows, so its converter stores, per head, rows 0, d/2, 1, d/2+1, ... Viewing each head as (d/2, 2) and swapping
    the two axes restores 0, 1, ..., d/2-1, d/2, ...
    """
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weight.shape)


def faithful_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The narrowest dtype that holds every dequantized value bit for bit; float32 always does."""
    for dtype in (torch.float16, torch.bfloat16):
        if all(torch.equal(t.to(dtype).float(), t) for t in tensors):
            return dtype
    return torch.float32


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
