"""Load a Hugging Face safetensors checkpoint (single file or sharded) into the Transformer.

The model is built on the meta device, then each parameter is filled from the checkpoint one tensor at a
time (read, transformed, cast, moved), so no second full copy of the weights is ever held in memory. A folder
may also hold quantized weights (quantized/model.safetensors, from a GGUF: model/quant.py): a linear layer whose
method keeps them quantized gets them as they are; anything else gets them dequantized. Then each linear
layer's method prepares its weight (packs, quantizes, measures its batch-invariance padding: model/linear.py).
"""

import json
import logging
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from model.config import ModelConfig
from model.gguf_blocks import BLOCKS, from_gguf_blocks
from model.linear import Linear
from model.quant import GGUF_PART, QUANTIZED_FILE, QuantizedTensor
from model.transformer import Norm, Ops, Transformer

log = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    pass


class Checkpoint:
    """Lazy access to the tensors of one or more safetensors files, by name: the dense files, or with
    quantized=True the quantized file where there is one (then a quantized weight reads as a QuantizedTensor)."""

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
        # stored name -> the GGUF type the converter dequantized it from (no kernel keeps that type quantized)
        self.dequantized: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="pt") as sf:
                self.files.update({name: f for name in sf.keys()})  # noqa: SIM118 (not a dict)
                self.dequantized.update(json.loads((sf.metadata() or {}).get("dequantized", "{}")))
        self._open: dict[Path, object] = {}

    def resolve(self, name: str) -> str | None:
        """The stored name: GPT-2 checkpoints may or may not prefix names with `transformer.`."""
        for candidate in (name, "transformer." + name):
            if any(c in self.files for c in (candidate, candidate + ".q4", candidate + ".q8")):
                return candidate
            if any(f"{candidate}.{GGUF_PART}{t}" in self.files for t in BLOCKS):
                return candidate
        return None

    def get(self, name: str) -> torch.Tensor | QuantizedTensor:
        if name in self.files:
            return self._read(name)
        for type_name, (size, nbytes) in BLOCKS.items():  # a GGUF type's blocks as the file holds them
            if (part := f"{name}.{GGUF_PART}{type_name}") in self.files:
                blocks = self._read(part)
                return from_gguf_blocks(
                    type_name, blocks, (blocks.shape[0], blocks.shape[1] // nbytes * size)
                )
        parts = ("q4", "q8", "scale", "min")
        return QuantizedTensor.from_parts(
            {p: self._read(f"{name}.{p}") for p in parts if f"{name}.{p}" in self.files}
        )

    def _read(self, name: str) -> torch.Tensor:
        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, framework="pt")
        return self._open[f].get_tensor(name)


def _source_names(name_map: dict, param: str) -> tuple[list[str], str] | None:
    m = re.match(r"layers\.(\d+)\.(.*)", param)
    key = f"layers.{{i}}.{m.group(2)}" if m else param
    if key not in name_map:
        return None
    names, transform = name_map[key]
    return [n.replace("{i}", m.group(1)) if m else n for n in names], transform


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: Ops | None = None,
) -> tuple[Transformer, ModelConfig]:
    """The checkpoint in `path` as a Transformer whose ops run as `ops` says (default: PyTorch ops)."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = Transformer(config, ops)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    ckpt = Checkpoint(path, quantized=any(m.method.keeps_quantized for m in linears.values()))
    name_map = config.family.weights
    dequantized: dict[str, list[int]] = {}  # GGUF type -> [tensors, bytes as loaded]: logged once, below
    for param_name, param in list(model.named_parameters()):
        # tied: the one [vocab, hidden] matrix is the LM head and the embedding, stored as the embedding
        key = "embed.weight" if param_name == "lm_head.weight" and config.tie_word_embeddings else param_name
        sources = _source_names(name_map, key)
        if sources is None:
            raise WeightLoadError(f"no checkpoint mapping for parameter {param_name}")
        names, transform = sources
        parts, kinds = [], []  # kinds: the GGUF type a dense part was dequantized from, by the converter
        for n in names:
            stored = ckpt.resolve(n)
            if stored is None:
                raise WeightLoadError(
                    f"tensor {n} is missing from the checkpoint in {path} (needed for {param_name})"
                )
            parts.append(ckpt.get(stored))
            kinds.append(ckpt.dequantized.get(stored))
        layer = linears.get(param_name.removesuffix(".weight"))
        if (
            layer is not None
            and layer.method.keeps_quantized
            and all(isinstance(t, QuantizedTensor) for t in parts)
        ):
            # one tensor, or one per format where a fused layer's parts differ (Q4_K q/k, Q6_K v)
            segments = QuantizedTensor.segments(parts)
            shape = (sum(s.shape[0] for s in segments), segments[0].shape[1])
            if shape != tuple(param.shape) or any(s.shape[1] != shape[1] for s in segments):
                raise WeightLoadError(f"shape mismatch for {param_name}: expected {tuple(param.shape)}, "
                                      f"the checkpoint's quantized weights make {[s.shape for s in segments]}")  # fmt: skip
            layer.quantized = segments[0] if len(segments) == 1 else segments  # packed by prepare(), below
            continue
        kinds = [t.kind if isinstance(t, QuantizedTensor) else k for t, k in zip(parts, kinds, strict=True)]
        for t, kind in zip(parts, kinds, strict=True):
            if kind is not None:
                entry = dequantized.setdefault(kind, [0, 0])
                entry[0] += 1
                entry[1] += math.prod(t.shape) * dtype.itemsize
        parts = [t.dequantize() if isinstance(t, QuantizedTensor) else t for t in parts]
        parts = [t.t() if transform == "t" else t for t in parts]
        tensor = torch.cat(parts) if transform == "cat" else parts[0]
        if config.norm_offset and isinstance(model.get_submodule(param_name.rpartition(".")[0]), Norm):
            # Gemma's norms multiply by 1 + w, computed in float32 as the reference does
            tensor = tensor.float() + config.norm_offset
        if tensor.shape != param.shape:
            shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(names, parts, strict=True))
            raise WeightLoadError(
                f"shape mismatch for {param_name}: expected {tuple(param.shape)}, checkpoint has {shapes}"
            )
        _set_param(model, param_name, tensor.to(device=device, dtype=dtype))
        del parts, tensor
    model.rope_tables_to(device)
    if dequantized:
        log.info(
            "GGUF types dequantized at load (as %s): %s", str(dtype).removeprefix("torch."),
            ", ".join(f"{k} x{n} ({b / 2**20:.1f} MiB)" for k, (n, b) in sorted(dequantized.items())),
        )  # fmt: skip
    quantized = {f"{name}.weight" for name, m in linears.items() if m.quantized is not None}
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and n not in quantized]
    if still_meta:
        raise WeightLoadError(f"parameters not loaded: {', '.join(still_meta)}")
    model.eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.prepare(module)
    model.weights_ready()
    return model, config


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, nn.Parameter(tensor.contiguous(), requires_grad=False))
