"""A GGUF file read in place, as the model it holds in Hugging Face terms: what `kvserve serve --model FILE.gguf`
(and the embedded default model) serves, with no converted copy on disk; weights/gguf_convert.py writes the same
thing out as a Hugging Face folder.

GGUFSource memory-maps the file (read_gguf: its header read as gguf's GGUFReader reads it, faster) and builds,
from its metadata alone, config.json's and generation_config.json's contents (weights/gguf_arch.py) and the
tokenizer (weights/gguf_tokenizer.py). Its
tensors are planned once (plan_tensors: which rows of which GGUF tensors make each Hugging Face tensor, with
llama.cpp's conversion undone: q/k rows, Gemma's and Qwen3.5's +1 on norms, fused or split q/k/v, RoPE tensors
into config, Qwen3.5's value heads and -exp(A_log), Qwen3-Next's rows grouped by key head)
and read on demand, by Hugging Face name, from the map:
- get(name): a 2-D weight made of one quantized type, with no arithmetic to undo, as a GGMLBlocks record (its
  block rows as they are: selecting and reordering rows is exact, since GGUF blocks run along K); anything else
  as a float32 tensor (F32 as stored, F16/BF16 widened, other types dequantized by gguf). A Hugging Face tensor
  that stacks every expert's (Granite MoE's [experts, rows, K]) reads as its experts' records stacked, or one
  expert's alone: get(name, expert).
- dense(name), dense(name, expert): the tensor in float32, whatever its type.
Nothing here knows kvserve's kernels: model/quant.py turns a GGMLBlocks record into its quantized weight.
"""

import mmap
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from weights.gguf_arch import (
    COMMON_KEYS,
    DENSE_FFN,
    GLOBAL_TENSORS,
    GROUPED_BY_KEY_HEAD,
    NEGATED_EXP,
    Family,
    Untile,
    attention_rows,
    expert_count,
    expert_size,
    family_for,
    key_head_groups,
    read_keys,
    rope_config,
    tensor_shapes,
    value_head_order,
    value_heads_tiled,
)
from weights.gguf_tokenizer import UnsupportedGGUFError, build_tokenizer

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
QKV = ("attn_q", "attn_k", "attn_v")  # the order llama.cpp stacks a fused attn_qkv in, as Hugging Face does
GATE_UP_EXPS = ("ffn_gate_exps", "ffn_up_exps")  # and a fused ffn_gate_up_exps, each expert's rows


class GGMLBlocks(NamedTuple):
    """A quantized weight [N, K] as the GGUF stores it, rows in Hugging Face's order (or every expert's,
    [experts, N, K])."""

    type_name: str  # the GGML type, e.g. "Q4_1"
    blocks: torch.Tensor  # uint8 [N, bytes per row] ([experts, N, ...]): each row's blocks, running along K
    shape: tuple[int, ...]  # [N, K] ([experts, N, K])


# GGUF value type -> (struct format, numpy dtype) of its scalars (gguf's GGUFValueType numbering)
SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
# tensor types numpy holds as numbers; every other type's rows are uint8 block bytes
NUMPY_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFTensor(NamedTuple):
    """A tensor of the file, as gguf's GGUFTensor describes one."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the row length first
    data_offset: int  # in the file
    n_bytes: int
    data: (
        np.ndarray
    )  # a view of the map, numpy's shape (rows first); block types as uint8 [..., bytes per row]


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor], mmap.mmap]:
    """(the metadata as gguf's ReaderField.contents() gives it, the tensors, the map they view).

    gguf's GGUFReader keeps a numpy view per value of the header: a tokenizer's 100k strings make ~1M of them, and
    SmolLM2's header took 1.1-3.2 s and ~110 MiB to parse (measured). This reads the same header (GGUF v2/v3,
    little-endian) into plain Python values in ~0.1 s; the tensors' data are views of the map, as there."""
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, dtype=np.uint8)
    view = memoryview(mapped)
    offset = 0

    def unpack(fmt: str):
        nonlocal offset
        (value,) = struct.unpack_from(fmt, view, offset)
        offset += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal offset
        size = unpack("<Q")
        offset += size
        return str(view[offset - size : offset], "utf-8")

    def value(kind: GGUFValueType):
        nonlocal offset
        if kind == GGUFValueType.STRING:
            return string()
        if kind != GGUFValueType.ARRAY:
            return unpack(SCALARS[kind])
        item, count = GGUFValueType(unpack("<I")), unpack("<Q")
        if item in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            return [value(item) for _ in range(count)]
        values = np.frombuffer(mapped, np.dtype(SCALARS[item]), count, offset)
        offset += values.nbytes
        return values.tolist()

    if bytes(view[:4]) != b"GGUF":
        raise UnsupportedGGUFError(f"{path.name} is not a GGUF file")
    offset = 4
    version = unpack("<I")
    if version not in (2, 3):
        raise UnsupportedGGUFError(
            f"{path.name}: GGUF version {version} (big-endian, or unknown) is not supported"
        )
    num_tensors, num_keys = unpack("<Q"), unpack("<Q")
    meta = {}
    for _ in range(num_keys):
        key = string()
        meta[key] = value(GGUFValueType(unpack("<I")))
    infos = []
    for _ in range(num_tensors):
        name = string()
        dims = tuple(unpack("<Q") for _ in range(unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(unpack("<I")), unpack("<Q")))
    alignment = meta.get("general.alignment", 32)
    start = -(-offset // alignment) * alignment
    tensors = {}
    for name, dims, kind, tensor_offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        n_bytes = int(np.prod(dims)) * size // block
        at = start + tensor_offset
        if kind in NUMPY_TYPES:
            array = data[at : at + n_bytes].view(NUMPY_TYPES[kind]).reshape(shape)
        else:
            array = data[at : at + n_bytes].reshape(*shape[:-1], shape[-1] // block * size)
        tensors[name] = GGUFTensor(name, kind, dims, at, n_bytes, array)
    return meta, tensors, mapped


POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's enum llama_pooling_type


class GGUFSource:
    """The model in a GGUF file, read from a memory map. Each tensor read is copied out of the map, and the map's
    pages it touched are let go (madvise): a loader that turns each weight into its own form as it goes holds
    that form only, never the file's pages besides.

    A Qwen3.5 file's DeltaNet value heads are served in the file's (llama.cpp's tiled) order, which the config
    says (`linear_value_heads_tiled`: the model reads each value head's key head accordingly), so that out_proj's
    K-quant blocks, each across two value heads, stay quantized: in Hugging Face's order they could not be
    reordered, and out_proj was dequantized to float32 (7x the bytes of Q4_K read at every token).
    hugging_face_order=True gives every tensor in Hugging Face's order instead (tests set them beside
    transformers')."""

    def __init__(self, path: str | Path, hugging_face_order: bool = False):
        self.path = Path(path)
        self.name = str(self.path)
        meta, self.tensors, self._map = read_gguf(self.path)  # the tensors' data are views of the map
        arch = meta.get("general.architecture")
        self.family = family_for(meta)
        try:
            self.config = model_config(self.family, meta, self.tensors)
            if self.family.tiled_value_heads and not hugging_face_order:
                self.config["linear_value_heads_tiled"] = value_heads_tiled(self.config)
            self.tokenizer, self.tokenizer_config = build_tokenizer(meta)
            self.tokenizer_config["model_max_length"] = self.config["max_position_embeddings"]
            self.shapes = expected_shapes(self.family, self.config)
            self.plan = checked_plan(self.family, self.tensors, self.config, self.shapes)
        except UnsupportedGGUFError as error:
            raise UnsupportedGGUFError(f"{self.path.name} ({arch!r}): {error}") from None
        keys = ("bos_token_id", "eos_token_id")
        self.generation_config = {k: self.config[k] for k in keys if self.config[k] is not None}
        # an embedder's or reranker's pooling as llama.cpp's converter records it (`<arch>.pooling_type`): none,
        # mean, cls, last or rank; None when the file says nothing (a causal LM)
        self.pooling_type = POOLING_TYPES.get(meta.get(f"{arch}.pooling_type"))
        # whether any weight is stored quantized (the engine then keeps it so where its kernels can)
        self.quantized = any(t.tensor_type not in FLOAT_TYPES for t in self.tensors.values())
        # one GGUF tensor (or expert's slice) can feed several Hugging Face ones (a fused attn_qkv, an expert's
        # fused gate and up), read one after another: the last such one dequantized is kept
        uses = Counter((piece.source, piece.expert) for pieces in self.plan.values() for piece in pieces)
        self._shared = {key for key, n in uses.items() if n > 1}
        self._last: tuple[tuple[str, int | None], np.ndarray] | None = None

    def resolve(self, name: str) -> str | None:
        return name if name in self.plan else None

    def get(self, name: str, expert: int | None = None) -> "torch.Tensor | GGMLBlocks":
        """The Hugging Face tensor `name` (expert: that expert's slice of a tensor stacking every expert's, read
        alone): its raw blocks where it is a quantized weight that needs no arithmetic, else float32."""
        pieces, shape = self._pieces(name, expert)
        if self._stacks_experts(pieces, shape):  # expert by expert (each, of the same pieces, blocks or not)
            parts = [self.get(name, e) for e in range(shape[0])]
            if isinstance(parts[0], GGMLBlocks):
                return GGMLBlocks(parts[0].type_name, torch.stack([p.blocks for p in parts]), shape)
            return torch.stack(parts)
        types = {self.tensors[p.source].tensor_type for p in pieces}
        (kind,) = types if len(types) == 1 else (None,)
        if kind is None or kind in FLOAT_TYPES or len(shape) != 2 or not all(p.exact(kind) for p in pieces):
            return self.dense(name, expert)
        rows = [order(p, stored(self.tensors[p.source], p.expert), kind) for p in pieces]
        blocks = np.concatenate(rows)  # a copy
        self._release(pieces)
        return GGMLBlocks(kind.name, torch.from_numpy(blocks), shape)

    def dense(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The Hugging Face tensor `name` (or one expert's slice, as get's) in float32 (exact for every type)."""
        pieces, shape = self._pieces(name, expert)
        if self._stacks_experts(pieces, shape):
            return torch.stack([self.dense(name, e) for e in range(shape[0])])
        # Gemma's norms: stored - 1 is exact for stored in [0.5, 2] (1 + w gives back stored), else rounded
        parts = [order(p, self._dequantized(p)) for p in pieces]
        parts = [
            part - np.float32(p.shift) if p.shift else part for p, part in zip(pieces, parts, strict=True)
        ]
        # Qwen3.5's ssm_a = -exp(A_log): the log gives A_log back to a rounding or two
        parts = [np.log(-part) if p.negated_exp else part for p, part in zip(pieces, parts, strict=True)]
        values = np.concatenate(parts)  # a copy, also of an F32 tensor (a view of the map)
        if values.shape != shape and squeezed(values.shape) == squeezed(shape):
            # a shared expert's gate stored 1-D ([hidden] for Hugging Face's [1, hidden]), a DeltaNet's
            # convolution [channels, taps] for [channels, 1, taps]
            values = values.reshape(shape)
        if values.shape != shape:
            raise UnsupportedGGUFError(f"{name}: pieces give shape {values.shape}, expected {shape}")
        self._release(pieces)
        return torch.from_numpy(values)

    def _pieces(self, name: str, expert: int | None) -> tuple[list["Piece"], tuple[int, ...]]:
        """The pieces of `name` and its shape, or of one expert's slice of a tensor stacking every expert's (each
        piece then that expert's slice of a GGUF tensor stacking every expert's)."""
        pieces, shape = self.plan[name], self.shapes[name]
        if expert is None:
            return pieces, shape
        if len(shape) != 3 or any(p.expert is not None for p in pieces):
            raise ValueError(f"{name} {shape} does not stack every expert's")
        return [replace(p, expert=expert) for p in pieces], shape[1:]

    def _stacks_experts(self, pieces: list["Piece"], shape: tuple[int, ...]) -> bool:
        """Whether the tensor is every expert's, [experts, N, K], read from GGUF tensors stacking every expert's
        (not a DeltaNet's convolution, [channels, 1, taps] of a 2-D GGUF tensor)."""
        return len(shape) == 3 and all(len(self.tensors[p.source].shape) == 3 for p in pieces)

    def _dequantized(self, piece: "Piece") -> np.ndarray:
        """The piece's GGUF tensor, or its expert's slice alone, in float32."""
        key = (piece.source, piece.expert)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        values = dequantize_tensor(self.tensors[piece.source], piece.expert)
        self._last = (key, values) if key in self._shared else None
        return values

    def _release(self, pieces: list["Piece"]) -> None:
        """Let the map's pages under these pieces' GGUF tensors (an expert's: its slice only) go. Harmless if
        read again: a read-only map's pages come back from the file (the page cache)."""
        page = mmap.PAGESIZE
        for source, expert in {(p.source, p.expert) for p in pieces}:
            tensor = self.tensors[source]
            at, size = tensor.data_offset, tensor.n_bytes
            if expert is not None:
                size //= tensor.data.shape[0]
                at += expert * size
            start = at // page * page
            self._map.madvise(mmap.MADV_DONTNEED, start, at + size - start)


def model_config(family: Family, meta: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """config.json in the dialect transformers 4.x and 5.x both read: top-level rope_theta and rope_scaling (5.x
    folds them into rope_parameters on load, per layer type for Gemma 3)."""
    config = {"architectures": [family.architecture], "model_type": family.model_type}
    # a family's own spelling of a common key (Qwen3.5-MoE's optional feed_forward_length) in its place
    per_layer = family.per_layer_keys
    config |= read_keys(
        meta, COMMON_KEYS | {k: v for k, v in family.keys.items() if k in COMMON_KEYS}, per_layer
    )
    hidden, num_heads = config["hidden_size"], config["num_attention_heads"]
    config |= read_keys(meta, {
        "num_key_value_heads": ("attention.head_count_kv", num_heads),
        "head_dim": ("attention.key_length", hidden // num_heads),  # explicit where it is not hidden / heads
        "value_head_dim": ("attention.value_length", None),
    }, per_layer)  # fmt: skip
    if config.pop("value_head_dim") not in (None, config["head_dim"]):
        raise UnsupportedGGUFError(f"value heads of another size than the keys ({config['head_dim']})")
    config |= {
        # GGUF shapes list the row length first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else 0,
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    config |= (
        read_keys(meta, {k: v for k, v in family.keys.items() if k not in COMMON_KEYS}) | family.constants
    )
    if config["intermediate_size"] is None:  # no dense FFN: the experts' size is the model's
        del config["intermediate_size"]
    config |= bias_switches(family, tensors, config["num_hidden_layers"])
    if family.extra:
        config |= family.extra(meta, config)
    rope = {}
    for name in family.rope_tensors:
        if f"{name}.weight" in tensors:
            rope[name] = dequantize_tensor(tensors[f"{name}.weight"])
    if family.from_tensors:  # what only the tensors say, its RoPE too (Gemma 4)
        shapes = {name: tuple(int(n) for n in tensor.shape) for name, tensor in tensors.items()}
        config |= family.from_tensors(meta, config, shapes, rope)
    else:
        config |= rope_config(family, meta, config, rope)
    # null where the GGUF has none, rather than the Hugging Face class's default (Phi-3's pad 32000, Gemma's eos 1)
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        config[name] = meta.get(f"tokenizer.ggml.{key}_token_id")
    return config


def bias_switches(family: Family, tensors: dict[str, GGUFTensor], num_layers: int) -> dict[str, bool]:
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
    expert: int | None = None  # the rows are this expert's, of a tensor stacking every expert's
    untile: Untile | None = None  # Qwen3.5's value heads, stored in llama.cpp's order
    negated_exp: bool = False  # stored as -exp(x) (Qwen3.5's ssm_a)

    def exact(self, kind: GGMLQuantizationType) -> bool:
        """Whether this piece's blocks of `kind` read as they are, selected and reordered but not computed on."""
        if self.shift or self.negated_exp:
            return False
        columns = self.untile is not None and self.untile.axis == 1
        return not columns or self.untile.in_blocks(GGML_QUANT_SIZES[kind][0]) is not None


def expected_shapes(family: Family, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor of the model and its shape, in the order they are written."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for name, module in family.global_tensors.items():
        if (shape := global_shape(config, name)) is not None:
            shapes[f"{module}.weight"] = shape
    biases = [name for group in family.biases if config.get(group.switch, True) for name in group.tensors]
    for layer in range(config["num_hidden_layers"]):
        per_layer = tensor_shapes(family, config, layer)
        for name, module in family.layer_tensors_of(config, layer).items():
            suffix = "" if name in family.bare else ".weight"
            if "{e}" in module:  # one Hugging Face tensor per expert
                for e in range(expert_count(config)):
                    expert_module = module.replace("{e}", str(e))
                    shapes[f"model.layers.{layer}.{expert_module}{suffix}"] = per_layer[name][1:]
            else:
                shapes[f"model.layers.{layer}.{module}{suffix}"] = per_layer[name]
        for name in biases:  # a bias per output row (an expert's: per expert)
            module = family.layer_tensors[name]
            if "{e}" in module:
                for e in range(expert_count(config)):
                    shapes[f"model.layers.{layer}.{module.replace('{e}', str(e))}.bias"] = per_layer[name][
                        1:-1
                    ]
            else:
                shapes[f"model.layers.{layer}.{module}.bias"] = per_layer[name][:-1]
    return shapes


def checked_plan(
    family: Family,
    gguf_tensors: dict[str, GGUFTensor],
    config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
) -> dict[str, list[Piece]]:
    """plan_tensors, each Hugging Face tensor's pieces in order, refused unless it makes exactly `shapes`."""
    plan = plan_tensors(family, gguf_tensors, config)
    if missing := [name for name in shapes if name not in plan]:
        raise UnsupportedGGUFError(f"GGUF lacks tensors for {missing[:5]} ({len(missing)} missing)")
    if extra := sorted(plan.keys() - shapes.keys()):
        sources = sorted({piece.source for name in extra for piece in plan[name]})
        raise UnsupportedGGUFError(f"GGUF tensors {sources[:5]} have no place in {family.architecture}")
    for name, pieces in plan.items():
        pieces.sort(key=lambda piece: piece.part)
        if [piece.part for piece in pieces] != list(range(len(pieces))):
            raise UnsupportedGGUFError(
                f"{name} is made of {[p.source for p in pieces]}: parts missing or repeated"
            )
    return {name: plan[name] for name in shapes}


def plan_tensors(
    family: Family, gguf_tensors: dict[str, GGUFTensor], config: dict[str, Any]
) -> dict[str, list[Piece]]:
    """Hugging Face tensor name -> the GGUF rows it is made of; refuses a GGUF tensor that has no place."""
    plan: dict[str, list[Piece]] = {}
    # llama.cpp's multi-token-prediction layers follow the model's (Qwen3.5's): kvserve does not run them
    layers = config["num_hidden_layers"]
    mtp = tuple(f"blk.{i}." for i in range(layers, layers + config.get("mtp_num_hidden_layers", 0)))
    for tensor in gguf_tensors.values():
        base, _, kind = tensor.name.rpartition(".")
        if kind == "weight" and base in family.rope_tensors:
            continue  # read into config.json's rope_scaling
        if mtp and tensor.name.startswith(mtp):
            continue
        expected, pieces = tensor_pieces(family, config, tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        # a 1 may be left out: llama.cpp reads a shared expert's gate [1, hidden] as [hidden], and writes a
        # DeltaNet's convolution [channels, 1, taps] as [channels, taps]
        if shape != expected and squeezed(shape) != squeezed(expected):
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
    if kind not in ("weight", "bias"):  # a tensor named without a suffix (Qwen3.5's ssm_a)
        base, kind = gguf_name, ""
    if kind == "weight" and base in GLOBAL_TENSORS:
        expected = (hidden,) if base == "output_norm" else (config["vocab_size"], hidden)
        shift = family.norm_shift if base == "output_norm" else 0.0
        return expected, [(f"{GLOBAL_TENSORS[base]}.weight", Piece(gguf_name, 0, slice(None), shift=shift))]
    if (
        kind == "weight"
        and base in family.global_tensors
        and (shape := global_shape(config, base)) is not None
    ):
        return shape, [(f"{family.global_tensors[base]}.weight", Piece(gguf_name, 0, slice(None)))]
    layer, _, short = base.removeprefix("blk.").partition(".")
    known = base.startswith("blk.") and layer.isdigit() and int(layer) < config["num_hidden_layers"]
    per_layer = tensor_shapes(family, config, int(layer) if known else None)
    suffixed = short in family.bare or kind in ("weight", "bias")
    if not known or not suffixed or short not in per_layer:
        raise UnsupportedGGUFError(f"tensor {gguf_name!r} has no {family.architecture} counterpart")
    if short in DENSE_FFN and "ffn_gate_inp" in family.layer_tensors and not family.dense_and_experts:
        raise UnsupportedGGUFError(
            f"tensor {gguf_name!r}: a dense FFN in a layer of {family.architecture}, whose layers are all "
            "sparse as llama.cpp builds it, is not supported"
        )
    if short == "attn_qkv" and short not in family.layer_tensors:
        # llama.cpp's --fuse-qkv stacked Hugging Face's q_proj, k_proj, v_proj
        rows = attention_rows(config)
        starts = np.cumsum([0] + [rows[name] for name in QKV]).tolist()
        targets = [
            (name, 0, slice(start, start + rows[name])) for name, start in zip(QKV, starts, strict=False)
        ]
    elif short in QKV and "attn_qkv" in family.layer_tensors and short not in family.layer_tensors:
        targets = [("attn_qkv", QKV.index(short), slice(None))]  # Phi-3 stored with q, k, v apart
    elif short in GATE_UP_EXPS and "ffn_gate_up_exps" in family.layer_tensors:
        # Granite MoE's Hugging Face tensor: each expert's gate rows, then its up rows, as a fused file has them
        targets = [("ffn_gate_up_exps", GATE_UP_EXPS.index(short), slice(None))]
    elif short == "ffn_gate_up_exps" and "ffn_gate_exps" in family.layer_tensors:
        # llama.cpp's --fuse-gate-up-exps: each expert's gate rows, then its up rows
        size = expert_size(config)
        targets = [("ffn_gate_exps", 0, slice(0, size)), ("ffn_up_exps", 0, slice(size, 2 * size))]
    elif short in GROUPED_BY_KEY_HEAD and family.grouped_by_key_head:
        targets = key_head_groups(
            config, short
        )  # Qwen3-Next's rows grouped by key head, as Qwen3.5's tensors
    elif short in family.layer_tensors:
        targets = [(short, 0, slice(None))]
    else:
        raise UnsupportedGGUFError(f"tensor {gguf_name!r} has no {family.architecture} counterpart")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    pieces = []
    for target, part, rows_slice in targets:
        module = family.layer_tensors[target]
        unpermute = heads.get(target, 0) if family.permute_qk else 0
        norm = kind == "weight" and target.endswith("norm") and target not in family.unshifted
        shift = family.norm_shift if norm else 0.0
        # Qwen3.5's value heads into Hugging Face's order, unless the model reads them as the file has them
        reorder = family.tiled_value_heads and not config.get("linear_value_heads_tiled")
        untile = value_head_order(config, target) if reorder else None
        # a tensor stacking every expert's: one piece per expert, of its own Hugging Face tensor
        experts = range(expert_count(config)) if "{e}" in module else [None]
        suffix = "" if short in family.bare else f".{kind}"
        for e in experts:
            name = f"model.layers.{layer}.{module.replace('{e}', str(e))}{suffix}"
            piece = Piece(gguf_name, part, rows_slice, unpermute, shift, e, untile, target in NEGATED_EXP)
            pieces.append((name, piece))
    return (per_layer[short] if kind != "bias" or short in family.bare else per_layer[short][:-1]), pieces


def global_shape(config: dict[str, Any], name: str) -> tuple[int, ...] | None:
    """The shape of a family's tensor outside the layers (Gemma 4's per-layer inputs'), or None where the model has
    none."""
    size = config.get("hidden_size_per_layer_input")
    if not size:
        return None
    width = config["num_hidden_layers"] * size
    return {
        "per_layer_token_embd": (config.get("vocab_size_per_layer_input", 0), width),
        "per_layer_model_proj": (width, config["hidden_size"]),
        "per_layer_proj_norm": (size,),
    }[name]


def stored(tensor: GGUFTensor, expert: int | None) -> np.ndarray:
    """The tensor's data as stored (a view of the map), or one expert's slice of it."""
    return tensor.data if expert is None else tensor.data[expert]


def order(piece: Piece, values: np.ndarray, kind: GGMLQuantizationType | None = None) -> np.ndarray:
    """The piece's rows of a GGUF tensor or expert's slice (dequantized, or its raw block rows of type `kind`) in
    Hugging Face's order."""
    values = values[piece.rows]
    if piece.heads:
        values = unpermute_rows(values, piece.heads)
    untile = piece.untile
    if untile is None:
        return values
    if untile.axis == 1 and kind is not None:  # raw rows: whole blocks reordered along each row (Piece.exact)
        block, size = GGML_QUANT_SIZES[kind]
        rows = values.reshape(values.shape[0], -1, size)
        return rows[:, untile.in_blocks(block).index(rows.shape[1])].reshape(values.shape)
    return np.take(values, untile.index(values.shape[untile.axis]), axis=untile.axis)


def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def dequantize_tensor(tensor: GGUFTensor, expert: int | None = None) -> np.ndarray:
    """The tensor, or one expert's slice of it alone (never the rest), in float32, shaped as numpy lists
    dimensions (F32: a read-only view of the map)."""
    shape = tuple(int(n) for n in reversed(tensor.shape))
    shape = shape if expert is None else shape[1:]
    data = stored(tensor, expert)
    if tensor.tensor_type == GGMLQuantizationType.F32:
        return data.reshape(shape)
    try:
        values = dequantize(data, tensor.tensor_type)
    except NotImplementedError:
        raise UnsupportedGGUFError(
            f"tensor {tensor.name}: type {tensor.tensor_type.name} cannot be dequantized"
        ) from None
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
