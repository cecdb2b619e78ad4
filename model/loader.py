"""Load a model into the Transformer: a Hugging Face safetensors folder (single file or sharded), or a model
source its caller opened (a GGUF file read in place: weights/gguf_source.py's GGUFSource).

A source is any object with `name`, `config` and `generation_config` (config.json's and generation_config.json's
contents), `quantized` (whether it stores quantized weights), `pooling_type` (an embedder's pooling: none, mean, cls, last,
rank; None for a causal LM), `tokenizer` and `tokenizer_config` (a `tokenizers`
Tokenizer and tokenizer_config.json's contents) and the two methods of a Checkpoint, `resolve(name)` and
`get(name)`. get() gives a tensor, or a GGUF weight's raw blocks as a record (type name, uint8 blocks [N, bytes
per row], shape [N, K]) that model/gguf_blocks.py reads.

The model is built on the meta device, then each parameter is filled from the checkpoint one tensor at a
time (read, transformed, cast, moved), so no second full copy of the weights is ever held in memory. A linear
layer whose method keeps quantized weights gets them as they are; anything else gets them dequantized. Each
linear layer's method prepares its weight (packs, quantizes, measures its batch-invariance padding:
model/linear.py) as soon as the layer is loaded, so only the prepared form of the weights accumulates.
"""

import ctypes
import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from model.config import LinearAttentionSpec, ModelConfig
from model.gguf_blocks import gguf_weight
from model.linear import Linear
from model.quant import QUANTIZED_FILE, QuantizedTensor
from model.transformer import Norm, Ops, Transformer

log = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    pass


class Checkpoint:
    """Lazy access to the tensors of one or more safetensors files, by name: the dense files, or with
    quantized=True the quantized file where there is one (then a quantized weight reads as its raw GGUF blocks,
    or, from a folder converted before kvserve kept those, as a QuantizedTensor)."""

    def __init__(self, path: Path, quantized: bool = False):
        index = path / "model.safetensors.index.json"
        dense = sorted(path.glob("*.safetensors"))
        self.quantized = (path / QUANTIZED_FILE).is_file() and (quantized or not dense)
        if self.quantized:
            files = [path / QUANTIZED_FILE]
        elif index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        else:
            files = dense
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {path}")
        self.files = {}
        self.ggml: dict[str, list] = {}  # name -> [GGML type name, N, K] of the raw quantized weights
        for f in files:
            with safe_open(f, framework="pt") as sf:
                self.files.update({name: f for name in sf.keys()})  # noqa: SIM118 (not a dict)
                self.ggml |= json.loads((sf.metadata() or {}).get("ggml", "{}"))
        self._open: dict[Path, object] = {}

    def resolve(self, name: str) -> str | None:
        """The stored name: GPT-2 checkpoints may or may not prefix names with `transformer.`; an embedder saved by
        sentence-transformers (Qwen3-Embedding) stores the backbone alone, without the `model.` prefix; a
        multimodal checkpoint (model/families.py's TEXT_MODEL_OF) keeps its text model's under
        `model.language_model.` (Qwen3.5's) or `language_model.` (Gemma 3's, its head too)."""
        language_model = (
            name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        )
        candidates = (
            name,
            "transformer." + name,
            name.removeprefix("model."),
            language_model,
            "language_model." + name,
        )
        for candidate in candidates:
            if any(c in self.files for c in (candidate, candidate + ".q4", candidate + ".q8")):
                return candidate
        return None

    def get(self, name: str, expert: int | None = None) -> torch.Tensor | QuantizedTensor | tuple:
        """expert: that expert's slice of a tensor stacking every expert's, read alone (a quantized one's
        [experts, N, bytes per row] blocks: that expert's rows)."""
        if expert is not None:
            rows = self._open_file(name).get_slice(name)[expert]
            if name in self.ggml:
                type_name, _, *shape = self.ggml[name]
                return type_name, rows, tuple(shape)
            return rows
        if name in self.ggml:
            type_name, *shape = self.ggml[name]
            return type_name, self._read(name), tuple(shape)
        if name in self.files:
            return self._read(name)
        parts = ("q4", "q8", "scale", "min")
        return QuantizedTensor.from_parts(
            {p: self._read(f"{name}.{p}") for p in parts if f"{name}.{p}" in self.files}
        )

    def _read(self, name: str) -> torch.Tensor:
        return self._open_file(name).get_tensor(name)

    def _open_file(self, name: str):
        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, framework="pt")
        return self._open[f]


def _source_names(name_map: dict, param: str, ckpt) -> tuple[list[str], str, int | None] | None:
    """The checkpoint names and transform of a parameter (of its spellings, the first the checkpoint holds), and
    its expert's index (None: not an expert's)."""
    m = re.match(r"layers\.(\d+)\.(.*)", param)
    key = f"layers.{{i}}.{m.group(2)}" if m else param
    e = re.search(r"\.experts\.(\d+)\.", key)
    key = key.replace(e.group(0), ".experts.{e}.") if e else key
    if key not in name_map:
        return None
    spellings = name_map[key] if isinstance(name_map[key], list) else [name_map[key]]

    def filled(name: str) -> str:
        name = name.replace("{i}", m.group(1)) if m else name
        return name.replace("{e}", e.group(1)) if e else name

    candidates = [([filled(n) for n in names], transform) for names, transform in spellings]
    # none held: the first, whose missing tensor the loader names
    names, transform = next(
        (c for c in candidates if all(ckpt.resolve(n) is not None for n in c[0])), candidates[0]
    )
    return names, transform, int(e.group(1)) if e else None


def model_name(model) -> str:
    """The model (a folder's path, or a source) as logs name it."""
    return str(model) if isinstance(model, str | Path) else model.name


def stores_quantized(model) -> bool:
    """Whether the model (a folder's path, or a source) stores quantized weights."""
    if isinstance(model, str | Path):
        return (Path(model) / QUANTIZED_FILE).is_file()
    return model.quantized


def load_model(
    model,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: Ops | None = None,
) -> tuple[Transformer, ModelConfig]:
    """The model (a Hugging Face folder's path, or a source: see above) as a Transformer whose ops run as `ops`
    says (default: PyTorch ops)."""
    if isinstance(model, str | Path):
        path = Path(model)
        config = ModelConfig.from_dir(path)
    else:
        path = model.name
        config = ModelConfig.from_dict(model.config, model.generation_config)
    with torch.device("meta"):
        transformer = Transformer(config, ops)
    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, Linear)}
    keeps_quantized = any(m.method.keeps_quantized for m in linears.values())
    ckpt = Checkpoint(path, quantized=keeps_quantized) if isinstance(model, str | Path) else model
    name_map = config.family.weights
    if not config.tie_word_embeddings and ckpt.resolve(name_map["lm_head.weight"][0][0]) is None:
        log.warning("%s has no LM head (an embedder's backbone): it serves embeddings, not generation", path)
        config = dataclasses.replace(config, tie_word_embeddings=True, has_lm_head=False)
        with torch.device("meta"):
            transformer = Transformer(config, ops)
        linears = {name: m for name, m in transformer.named_modules() if isinstance(m, Linear)}
    params = list(transformer.named_parameters())
    # each linear layer is prepared once its last parameter is loaded
    last_of = {name.rpartition(".")[0]: name for name, _ in params}
    # GGML type -> [weights, bytes stored, bytes in float32] of the weights no kernel keeps quantized
    dequantized: dict[str, list[int]] = {}
    read_since_trim = 0  # bytes of weights read since the heap's free pages were last handed back
    # every parameter is filled (or, quantized, given to its layer) in this loop, or the load fails naming it
    for param_name, param in params:
        # tied: the one [vocab, hidden] matrix is the LM head and the embedding, stored as the embedding
        key = "embed.weight" if param_name == "lm_head.weight" and config.tie_word_embeddings else param_name
        sources = _source_names(name_map, key, ckpt)
        if sources is None:
            raise WeightLoadError(f"no checkpoint mapping for parameter {param_name}")
        names, transform, expert = sources
        parts = []
        for n in names:
            stored = ckpt.resolve(n)
            if stored is None:
                raise WeightLoadError(
                    f"tensor {n} is missing from the checkpoint in {path} (needed for {param_name})"
                )
            parts.append(_read(ckpt, stored, dequantized, expert if transform.startswith("expert") else None))
        read_since_trim += sum(_nbytes(t) for t in parts)
        module_name = param_name.rpartition(".")[0]
        module = transformer.get_submodule(module_name)
        layer = linears.get(module_name)
        if (
            layer is not None
            and layer.method.keeps_quantized
            and all(isinstance(t, QuantizedTensor) for t in parts)
            and transform != "ungroup_qkvz_ba"  # rows regrouped: dequantized below
        ):
            # one tensor, or one per format where a fused layer's parts differ (Q4_K q/k, Q6_K v)
            segments = QuantizedTensor.segments(parts)
            shape = (sum(seg.shape[0] for seg in segments), segments[0].shape[1])
            if shape != tuple(param.shape) or any(seg.shape[1] != shape[1] for seg in segments):
                raise WeightLoadError(f"shape mismatch for {param_name}: expected {tuple(param.shape)}, the "
                                      f"checkpoint's quantized weights make {[seg.shape for seg in segments]}")  # fmt: skip
            layer.quantized = segments[0] if len(segments) == 1 else segments  # packed by prepare(), below
        else:
            parts = [t.dequantize() if isinstance(t, QuantizedTensor) else t for t in parts]
            parts = [t.t() if transform in ("t", "expert_t", "expert_t_pairs") else t for t in parts]
            if transform.endswith("_pairs"):  # interleaved gate and up rows (GPT-OSS) as [gate; up]
                parts = [torch.cat((t[0::2], t[1::2])) for t in parts]
            if transform == "ungroup_qkvz_ba":  # Qwen3-Next's rows grouped by key head, as DeltaNet's in_proj
                parts = [ungroup_qkvz_ba(*parts, config.linear_attention)]
            tensor = torch.cat(parts) if transform == "cat" else parts[0]
            if config.norm_offset and isinstance(module, Norm):
                # Gemma's norms multiply by 1 + w, computed in float32 as the reference does
                tensor = tensor.float() + config.norm_offset
            if tensor.shape != param.shape:
                shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(names, parts, strict=True))
                raise WeightLoadError(
                    f"shape mismatch for {param_name}: expected {tuple(param.shape)}, checkpoint has {shapes}"
                )
            # a module may keep its weights in a dtype of its own (model/moe.py's float32 router)
            stored_dtype = getattr(module, "stored_dtype", dtype)
            _set_param(transformer, param_name, tensor.to(device=device, dtype=stored_dtype))
            del tensor
        del parts
        if layer is not None and last_of[module_name] == param_name:
            layer.method.prepare(layer)  # its weight in the form it runs in; what was read is let go
        if read_since_trim >= TRIM_EVERY:
            return_freed_memory()
            read_since_trim = 0
    if dequantized:
        log.info(
            "dequantized at load (no kernel keeps these types quantized): %s",
            ", ".join(
                f"{kind} x {n} ({stored / 2**20:.1f} MiB stored, {dense / 2**20:.1f} MiB in float32)"
                for kind, (n, stored, dense) in sorted(dequantized.items())
            ),
        )
    transformer.rope_tables_to(device)
    transformer.eval().requires_grad_(False)
    transformer.weights_ready()
    return_freed_memory()
    return transformer, config


# The heap's free pages go back to the OS every this many bytes of weights read (as the loader holds them: a 4-bit
# weight's integer a byte), not only at the end: an MoE's experts are
# thousands of small weights whose freed copies (below glibc's mmap threshold) piled up in the heap until then
# (a 30B-A3B Q4_K_M's load peaked 2.6 GiB above its steady state; the 12-layer cut's 828 MiB -> 189 MiB, its load
# 24.7 -> 25.4 s, measured 2026-11-29)
TRIM_EVERY = 256 << 20


def _nbytes(t: torch.Tensor | QuantizedTensor) -> int:
    if isinstance(t, QuantizedTensor):
        return t.q.numel() * t.q.element_size()  # its scales are a few percent more
    return t.numel() * t.element_size()


def return_freed_memory() -> None:
    """Hands the C heap's free pages back to the OS. Loading reads each weight, unpacks it and packs it, one at
    a time: glibc keeps the freed copies under its mmap threshold (which grows to 32 MiB) in its heap, resident,
    ~320 MiB after a 1B Q8_0 file's load (2,183 -> 1,861 MiB, measured 2026-11-27). Elsewhere than glibc, no-op."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def ungroup_qkvz_ba(qkvz: torch.Tensor, ba: torch.Tensor, spec: LinearAttentionSpec) -> torch.Tensor:
    """Qwen3-Next's DeltaNet input projections as the one in_proj of model/deltanet.py, [q | k | v | z | b | a],
    each part's heads in order. The checkpoint groups its rows by key head (transformers'
    fix_query_key_value_ordering): in_proj_qkvz holds, for each of the num_key_heads groups, that key head's q
    (key_head_dim rows), k (key_head_dim), then the v and z of the group's value heads (g x value_head_dim each,
    g = value heads per key head); in_proj_ba, for each group, its g b rows then its g a rows. Value head j of
    group h is head h * g + j, as the key head's q and k are repeated for it."""
    g = spec.num_value_heads // spec.num_key_heads
    groups = qkvz.reshape(spec.num_key_heads, -1, *qkvz.shape[1:])  # [key heads, 2 dk + 2 g dv, ...]
    kd, vd = spec.key_head_dim, g * spec.value_head_dim
    q, k, v, z = groups.split((kd, kd, vd, vd), dim=1)
    b, a = ba.reshape(spec.num_key_heads, 2 * g, *ba.shape[1:]).split((g, g), dim=1)
    return torch.cat([part.reshape(-1, *qkvz.shape[1:]) for part in (q, k, v, z, b, a)])


def _read(
    ckpt, name: str, dequantized: dict[str, list[int]], expert: int | None = None
) -> torch.Tensor | QuantizedTensor:
    """The stored tensor (expert: that expert's slice of a tensor stacking every expert's); a GGUF weight's raw
    blocks as its QuantizedTensor, or dequantized (and counted in `dequantized`) where no kernel keeps its
    type."""
    value = ckpt.get(name) if expert is None else ckpt.get(name, expert)
    if isinstance(value, torch.Tensor | QuantizedTensor):
        return value
    type_name, blocks, shape = value
    weight = gguf_weight(type_name, blocks, shape)
    if isinstance(weight, torch.Tensor):
        counts = dequantized.setdefault(type_name, [0, 0, 0])
        for i, n in enumerate((1, blocks.numel(), weight.numel() * 4)):
            counts[i] += n
    return weight


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor.contiguous(), requires_grad=False))
