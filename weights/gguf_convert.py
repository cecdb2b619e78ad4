"""Convert a GGUF file into the Hugging Face folder layout kvserve loads, and transformers loads to the same model.

Every architecture in weights/gguf_arch.py's FAMILIES (Llama 2/3.x and Mistral, Qwen 2/3, Gemma 2/3, Phi-3, OLMo 2,
Granite, SmolLM3). The folder gets config.json (transformers' format), generation_config.json, tokenizer.json,
tokenizer_config.json (weights/gguf_tokenizer.py), and the weights under Hugging Face tensor names and row order,
with llama.cpp's conversion undone (q/k rows, Gemma's +1 on norms, fused or split q/k/v, RoPE tensors into config):
- quantized/model.safetensors: the GGUF's Q4_0, Q4_1, Q8_0, K-quant, Q5 and IQ4 tensors as they are (exact
  integers and scales, see QUANTIZED_FORMAT), every other tensor dequantized to float32. kvserve serves it on CPU.
- model.safetensors (unless dense=False): every tensor dequantized, for the dequantized path and transformers.
Anything the converter cannot reproduce faithfully raises UnsupportedGGUFError naming it, rather than writing a
subtly wrong model.
"""

import json
import logging
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from weights.gguf_arch import (
    COMMON_KEYS,
    GLOBAL_TENSORS,
    Family,
    attention_rows,
    family_for,
    read_keys,
    rope_config,
    tensor_shapes,
)
from weights.gguf_tokenizer import UnsupportedGGUFError, build_tokenizer

log = logging.getLogger(__name__)

# in a sub-folder, so that tools reading every top-level *.safetensors of the folder (llama.cpp's converter,
# vLLM) never meet it
QUANTIZED_FILE = "quantized/model.safetensors"
# How quantized/model.safetensors stores a quantized weight W [N, K] (groups of 32 along K), read by
# model/quant.py: "W.q4" uint8 [N, K / 2] (q[2i] | q[2i + 1] << 4, w = scale * q + min), "W.q8" int8 [N, K]
# (w = scale * q), "W.scale" and "W.min" float16 [N, K / 32]; the other kept types as their GGUF blocks, rows
# in Hugging Face order: "W.gguf_<type>" uint8 [N, bytes per row] (model/gguf_blocks.py parses them). Dense tensors
# keep their plain name; the metadata's "dequantized" maps those dequantized from a GGUF type to it (JSON).
QUANTIZED_FORMAT = "kvserve-quantized-2"
KEPT_QUANTIZED = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
KEPT_AS_BLOCKS = tuple(
    GGMLQuantizationType[t] for t in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
)
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
QKV = ("attn_q", "attn_k", "attn_v")  # the order llama.cpp stacks a fused attn_qkv in, as Hugging Face does


def convert_gguf(src: Path, dst: Path, progress: bool = True, dense: bool = True) -> None:
    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    family = family_for(arch)
    gguf_tensors = {tensor.name: tensor for tensor in reader.tensors}
    try:
        config = model_config(family, meta, gguf_tensors)
        # The tokenizer is cheap to build, so an unsupported one fails before the slow part.
        tokenizer, tokenizer_config = build_tokenizer(meta)
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]
        tensors, quantized, dequantized = convert_tensors(family, gguf_tensors, config, progress, dense)
    except UnsupportedGGUFError as error:
        raise UnsupportedGGUFError(f"{src.name} ({arch!r}): {error}") from None
    # the dtype that holds every dequantized value bit for bit (the quantized file's dense tensors are float32)
    dtype = faithful_dtype(list(tensors.values())) if dense else torch.float32
    config["torch_dtype"] = str(dtype).removeprefix("torch.")

    dst.mkdir(parents=True, exist_ok=True)
    files = {
        QUANTIZED_FILE: (quantized, {"format": QUANTIZED_FORMAT, "dequantized": json.dumps(dequantized)})
    }
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
    special_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    write_json(dst / "generation_config.json", special_ids)


def model_config(family: Family, meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """config.json in the dialect transformers 4.x and 5.x both read: top-level rope_theta and rope_scaling (5.x
    folds them into rope_parameters on load, per layer type for Gemma 3)."""
    config = {"architectures": [family.architecture], "model_type": family.model_type}
    config |= read_keys(meta, COMMON_KEYS)
    hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
    config |= read_keys(meta, {
        "num_key_value_heads": ("attention.head_count_kv", num_heads),
        "head_dim": ("attention.key_length", hidden // num_heads),  # explicit where it is not hidden / heads
        "value_head_dim": ("attention.value_length", None),
    })  # fmt: skip
    if config.pop("value_head_dim") not in (None, config["head_dim"]):
        raise UnsupportedGGUFError(f"value heads of another size than the keys ({config['head_dim']})")
    config |= {
        # GGUF shapes list the row length first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else 0,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    config |= read_keys(meta, family.keys) | family.constants
    config |= bias_switches(family, tensors, config["num_hidden_layers"])
    if family.extra:
        config |= family.extra(meta, config)
    rope = {}
    for name in family.rope_tensors:
        if f"{name}.weight" in tensors:
            rope[name] = dequantize_tensor(tensors[f"{name}.weight"])
    config |= rope_config(family, meta, config, rope)
    # null where the GGUF has none, rather than the Hugging Face class's default (Phi-3's pad 32000, Gemma's eos 1)
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        config[name] = meta.get(f"tokenizer.ggml.{key}_token_id")
    return config


def bias_switches(family: Family, tensors: dict[str, ReaderTensor], num_layers: int) -> dict[str, bool]:
    """Each bias group's config switch: on where the GGUF has the group's biases, in every layer, else refused."""
    switches = {}
    for group in family.biases:
        wanted = [(layer, name) for layer in range(num_layers) for name in group.tensors]
        # a fused attn_qkv.bias holds the q, k and v biases
        have = [
            f"blk.{layer}.{name}.bias"
            for layer, name in wanted
            if f"blk.{layer}.{name}.bias" in tensors
            or (name in QKV and f"blk.{layer}.attn_qkv.bias" in tensors)
        ]
        if (have and len(have) < len(wanted)) or (not have and group.switch is None):
            missing = sorted({f"blk.{layer}.{name}.bias" for layer, name in wanted} - set(have))
            raise UnsupportedGGUFError(
                f"{have[0] if have else family.model_type}: Hugging Face's {family.architecture} has biases on "
                f"{', '.join(group.tensors)} in every layer or none; this GGUF lacks {len(missing)} "
                f"(e.g. {missing[0]})"
            )
        if group.switch is not None:
            switches[group.switch] = bool(have)
    return switches


@dataclass(frozen=True)
class Piece:
    """Rows of one GGUF tensor that become rows of one Hugging Face tensor."""

    source: str  # GGUF tensor name
    part: int  # place among the pieces of its Hugging Face tensor (q, k, v of a fused qkv_proj)
    rows: slice
    heads: int = 0  # > 0: undo llama.cpp's q/k row order over this many heads
    shift: float = 0.0  # what llama.cpp's converter added (Gemma's norms)


def expected_shapes(family: Family, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of the model and its shape, in the order they are written."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    per_layer = tensor_shapes(family, config)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    biases = [name for group in family.biases if config.get(group.switch, True) for name in group.tensors]
    for layer in range(config["num_hidden_layers"]):
        for name, module in family.layer_tensors.items():
            shapes[f"model.layers.{layer}.{module}.weight"] = per_layer[name]
        for name in biases:
            shapes[f"model.layers.{layer}.{family.layer_tensors[name]}.bias"] = per_layer[name][:1]
    return shapes


def plan_tensors(
    family: Family, gguf_tensors: dict[str, ReaderTensor], config: dict[str, Any]
) -> dict[str, list[Piece]]:
    """Hugging Face tensor name -> the GGUF rows it is made of; refuses a GGUF tensor that has no place."""
    plan: dict[str, list[Piece]] = {}
    for tensor in gguf_tensors.values():
        base, _, kind = tensor.name.rpartition(".")
        if kind == "weight" and base in family.rope_tensors:
            continue  # read into config.json's rope_scaling
        expected, pieces = tensor_pieces(family, config, tensor.name)
        if (shape := tuple(int(n) for n in reversed(tensor.shape))) != expected:
            raise UnsupportedGGUFError(f"tensor {tensor.name}: shape {shape}, expected {expected}")
        for name, piece in pieces:
            plan.setdefault(name, []).append(piece)
    return plan


def tensor_pieces(
    family: Family, config: dict[str, Any], gguf_name: str
) -> tuple[tuple[int, ...], list[tuple[str, Piece]]]:
    """(the GGUF tensor's expected shape, the Hugging Face tensors its rows go to)."""
    hidden = config["hidden_size"]
    base, _, kind = gguf_name.rpartition(".")
    if kind == "weight" and base in GLOBAL_TENSORS:
        expected = (hidden,) if base == "output_norm" else (config["vocab_size"], hidden)
        shift = family.norm_shift if base == "output_norm" else 0.0
        return expected, [(f"{GLOBAL_TENSORS[base]}.weight", Piece(gguf_name, 0, slice(None), shift=shift))]
    layer, _, short = base.removeprefix("blk.").partition(".")
    per_layer = tensor_shapes(family, config)
    known = base.startswith("blk.") and layer.isdigit() and int(layer) < config["num_hidden_layers"]
    if not known or kind not in ("weight", "bias") or short not in per_layer:
        raise UnsupportedGGUFError(f"tensor {gguf_name!r} has no {family.architecture} counterpart")
    if short == "attn_qkv" and short not in family.layer_tensors:
        # llama.cpp's --fuse-qkv stacked Hugging Face's q_proj, k_proj, v_proj
        rows = attention_rows(config)
        starts = np.cumsum([0] + [rows[name] for name in QKV]).tolist()
        targets = [
            (name, 0, slice(start, start + rows[name])) for name, start in zip(QKV, starts, strict=False)
        ]
    elif short in QKV and "attn_qkv" in family.layer_tensors:
        targets = [("attn_qkv", QKV.index(short), slice(None))]  # Phi-3 stored with q, k, v apart
    elif short in family.layer_tensors:
        targets = [(short, 0, slice(None))]
    else:
        raise UnsupportedGGUFError(f"tensor {gguf_name!r} has no {family.architecture} counterpart")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    pieces = []
    for target, part, rows_slice in targets:
        name = f"model.layers.{layer}.{family.layer_tensors[target]}.{kind}"
        unpermute = heads.get(target, 0) if family.permute_qk else 0
        shift = family.norm_shift if kind == "weight" and target.endswith("norm") else 0.0
        pieces.append((name, Piece(gguf_name, part, rows_slice, unpermute, shift)))
    return (per_layer[short] if kind == "weight" else per_layer[short][:1]), pieces


def convert_tensors(
    family: Family, gguf_tensors: dict[str, ReaderTensor], config: dict[str, Any], progress: bool, dense: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the dequantized tensors, or {} without dense; quantized/model.safetensors' tensors; the names of its
    tensors dequantized from a GGUF type, and the type)."""
    shapes = expected_shapes(family, config)
    plan = plan_tensors(family, gguf_tensors, config)
    if missing := [name for name in shapes if name not in plan]:
        raise UnsupportedGGUFError(f"GGUF lacks tensors for {missing[:5]} ({len(missing)} missing)")
    if extra := sorted(plan.keys() - shapes.keys()):
        sources = sorted({piece.source for name in extra for piece in plan[name]})
        raise UnsupportedGGUFError(f"GGUF tensors {sources[:5]} have no place in {family.architecture}")

    # one GGUF tensor can feed three Hugging Face ones (a fused attn_qkv), which come one after another
    @lru_cache(maxsize=1)
    def dense_source(name: str) -> np.ndarray:
        return dequantize_tensor(gguf_tensors[name])

    @lru_cache(maxsize=1)
    def kept_source(name: str) -> dict[str, np.ndarray]:
        tensor = gguf_tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if tensor.tensor_type in KEPT_AS_BLOCKS:
            blocks = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(shape[0], -1)
            return {f"gguf_{tensor.tensor_type.name}": blocks}
        return quantized_parts(tensor, shape)

    def order(piece: Piece, values: np.ndarray) -> np.ndarray:
        values = values[piece.rows]
        return unpermute_rows(values, piece.heads) if piece.heads else values

    tensors, quantized, dequantized = {}, {}, {}
    for name, shape in tqdm(
        shapes.items(), desc="Converting GGUF tensors", unit="tensor", disable=not progress
    ):
        pieces = sorted(plan[name], key=lambda piece: piece.part)
        if [piece.part for piece in pieces] != list(range(len(pieces))):
            raise UnsupportedGGUFError(
                f"{name} is made of {[p.source for p in pieces]}: parts missing or repeated"
            )
        types = {gguf_tensors[piece.source].tensor_type for piece in pieces}
        # kept quantized: 2-D weights whose pieces share one kept type and need no arithmetic
        kept = len(types) == 1 and types <= {*KEPT_QUANTIZED, *KEPT_AS_BLOCKS} and len(shape) == 2
        kept = kept and not any(piece.shift for piece in pieces)
        if kept:
            parts = [{k: order(p, v) for k, v in kept_source(p.source).items()} for p in pieces]
            quantized |= {
                f"{name}.{k}": torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]
            }
        if dense or not kept:
            # Gemma's norms: stored - 1 is exact for stored in [0.5, 2] (1 + w gives back stored), else rounded
            values = np.concatenate([order(p, dense_source(p.source)) - np.float32(p.shift) for p in pieces])
            if values.shape != shape:
                raise UnsupportedGGUFError(f"{name}: pieces give shape {values.shape}, expected {shape}")
            values = torch.from_numpy(np.ascontiguousarray(values))
            if dense:
                tensors[name] = values
            if not kept:
                quantized[name] = values
                if kinds := {t.name for t in types if t not in FLOAT_TYPES}:
                    dequantized[name] = "+".join(sorted(kinds))
    if dequantized:
        types, nbytes = Counter(dequantized.values()), Counter()
        for name, kind in dequantized.items():
            nbytes[kind] += quantized[name].numel() * 4
        counts = ", ".join(f"{k} x{n} ({nbytes[k] / 2**20:.1f} MiB)" for k, n in sorted(types.items()))
        log.info(
            "dequantized to float32 in %s (no kernel keeps these types quantized): %s", QUANTIZED_FILE, counts
        )
    return tensors, quantized, dequantized


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
