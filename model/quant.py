"""Quantized weights: GGUF's Q4_0, Q4_1 and Q8_0 blocks, or int4 / int8 made at load, kept quantized in memory
and multiplied by kvserve's C++ kernel (model/csrc/quant_gemm.cpp).

A QuantizedTensor holds a weight's exact integers and per-group scales, in a plain [N, K] form that the loader
can fuse (q/k/v, gate/up) and quantize into. It is made from a GGUF tensor's raw block rows, however they come:
read in place from the GGUF file (weights/gguf_source.py) or from quantized/model.safetensors, where
`kvserve convert-gguf` keeps them (weights/gguf_convert.py); from_gguf_blocks() is the one place that reads a
block format. QuantizedLinear, the weight format of model/linear.py's seam, packs it into the kernel's layout
once, at load. Any other GGML type is dequantized at load (gguf_weight) and runs through the dense method.
"""

from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32  # weights per scale, along K
TILE = 16  # output rows per tile of the packed layout
# a sub-folder: tools that read every top-level *.safetensors skip it. weights/gguf_convert.py writes it: each
# quantized weight W [N, K] as its raw GGML block rows "W" (uint8 [N, bytes per row]), its type and shape in the
# metadata; folders converted before (format kvserve-quantized-1) hold "W.q4" uint8 [N, K / 2] (q[2i] |
# q[2i + 1] << 4) or "W.q8" int8 [N, K], "W.scale" and (4 bits) "W.min" float16 [N, K / 32] (from_parts)
QUANTIZED_FILE = "quantized/model.safetensors"


@dataclass
class QuantizedTensor:
    """[N, K] weights in groups of 32 along K: bits 4, w = scale * q + min (q in 0..15); bits 8, w = scale * q
    (q in -127..127). Scales and minimums are float16, as GGUF stores them."""

    bits: int
    q: torch.Tensor  # [N, K] uint8 (4 bits) or int8
    scale: torch.Tensor  # [N, K / 32] float16
    min: torch.Tensor | None = None  # [N, K / 32] float16, 4 bits only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """The exact weights, float32 [N, K] (scale * q, then + min: two roundings, as the kernel's rows)."""
        N, K = self.shape
        w = self.q.view(N, K // GROUP, GROUP).float() * self.scale.float()[..., None]
        if self.min is not None:
            w = w + self.min.float()[..., None]
        return w.view(N, K)

    def select_rows(self, index: torch.Tensor) -> "QuantizedTensor":
        m = self.min[index] if self.min is not None else None
        return QuantizedTensor(self.bits, self.q[index], self.scale[index], m)

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Rows of several weights one after the other (fused q/k/v, gate/up)."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different formats")
        mins = None if parts[0].min is None else torch.cat([p.min for p in parts])
        return QuantizedTensor(
            parts[0].bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), mins
        )

    @staticmethod
    def quantize(weight: torch.Tensor, bits: int) -> "QuantizedTensor":
        """Round a dense [N, K] weight to the nearest grid per group, scales and minimums in float16: 8 bits
        symmetric (absmax / 127, as GGUF's Q8_0), 4 bits from the group's minimum in 15 steps (as Q4_1)."""
        N, K = weight.shape
        if K % GROUP:
            raise ValueError(f"cannot quantize a weight of {K} columns: not a multiple of {GROUP}")
        w = weight.float().view(N, K // GROUP, GROUP)
        if bits == 8:
            scale = (w.abs().amax(-1) / 127).half()
            step = torch.where(scale > 0, scale.float(), 1)[..., None]
            q = torch.round(w / step).clamp(-127, 127).to(torch.int8)
            return QuantizedTensor(8, q.view(N, K), scale)
        if bits == 4:
            lo = w.amin(-1).half()
            scale = ((w.amax(-1) - lo.float()) / 15).half()
            step = torch.where(scale > 0, scale.float(), 1)[..., None]
            q = torch.round((w - lo.float()[..., None]) / step).clamp(0, 15)
            return QuantizedTensor(4, q.to(torch.uint8).view(N, K), scale, lo)
        raise ValueError(f"cannot quantize to {bits} bits: 4 or 8")

    @staticmethod
    def from_parts(parts: dict[str, torch.Tensor]) -> "QuantizedTensor":
        """From the parts of one weight in a folder converted before kvserve kept raw blocks (format
        kvserve-quantized-1: keys q4 or q8, scale, min)."""
        if "q8" in parts:
            return QuantizedTensor(8, parts["q8"], parts["scale"])
        packed = parts["q4"]  # two 4-bit values per byte, the first in the low nibble
        q = torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)
        return QuantizedTensor(4, q, parts["scale"], parts["min"])

    @staticmethod
    def from_gguf_blocks(
        type_name: str, blocks: torch.Tensor, shape: tuple[int, int]
    ) -> "QuantizedTensor | None":
        """A GGUF weight [N, K] from its raw block rows (uint8 [N, bytes per row], blocks running along K, as
        ggml-common.h lays them out), exact: no value is recomputed. None for a type no kernel keeps."""
        if type_name not in GGUF_BLOCKS:
            return None
        weights, size, read = GGUF_BLOCKS[type_name]
        N, K = shape
        if K % weights or tuple(blocks.shape) != (N, K // weights * size):
            raise ValueError(f"{type_name} blocks of shape {tuple(blocks.shape)} for a [{N}, {K}] weight")
        return read(blocks.view(N, K // weights, size), N, K)

    def pack(self) -> dict[str, torch.Tensor]:
        """The kernel's layout (model/csrc/quant_gemm.cpp): rows in tiles of 16, padded with zero rows."""
        N, K = self.shape
        pad = -N % TILE
        T, G = (N + pad) // TILE, K // GROUP

        def tiles(x: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [T, 16, ...], zero rows added
            return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)).view(T, TILE, *x.shape[1:])

        def per_group(x: torch.Tensor) -> torch.Tensor:  # [N, G] -> [T, G, 16]
            return tiles(x).permute(0, 2, 1).contiguous()

        if self.bits == 4:  # chunk c, byte 2j + i: lane j's q[4c + i] | q[4c + 2 + i] << 4
            q = tiles(self.q).view(T, TILE, G, 8, 4)
            packed = (q[..., 0:2] | (q[..., 2:4] << 4)).permute(0, 2, 3, 1, 4)
            return {"packed": packed.contiguous().view(T, G, 256), "scales": per_group(self.scale),
                    "mins": per_group(self.min)}  # fmt: skip
        # chunk c, byte 2j + i: lane j's q[2c + i]
        packed = tiles(self.q).view(T, TILE, G, 16, 2).permute(0, 2, 3, 1, 4).contiguous()
        return {"packed": packed.view(torch.uint8).view(T, G, 512), "scales": per_group(self.scale)}


def _half(b: torch.Tensor) -> torch.Tensor:  # [N, G, 2] bytes -> [N, G] float16 (GGUF is little-endian)
    return b.contiguous().view(torch.float16)[..., 0]


def _q8_0(b: torch.Tensor, N: int, K: int) -> QuantizedTensor:  # block: float16 d, int8 q[32]; w = d q
    return QuantizedTensor(8, b[..., 2:34].contiguous().view(torch.int8).reshape(N, K), _half(b[..., 0:2]))


def _nibbles(qs: torch.Tensor, N: int, K: int) -> torch.Tensor:
    # a block's 16 bytes hold its values 0..15 in their low nibbles and 16..31 in their high nibbles
    return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, K)


def _q4_1(b: torch.Tensor, N: int, K: int) -> QuantizedTensor:  # block: float16 d, m, 16 bytes; w = d q + m
    return QuantizedTensor(4, _nibbles(b[..., 4:20], N, K), _half(b[..., 0:2]), _half(b[..., 2:4]))


def _q4_0(b: torch.Tensor, N: int, K: int) -> QuantizedTensor:  # block: float16 d, 16 bytes; w = d (q - 8)
    # = d q + (-8 d), and -8 d is exact in float16 unless it overflows
    scale = _half(b[..., 0:2])
    return QuantizedTensor(4, _nibbles(b[..., 2:18], N, K), scale, (-8 * scale.float()).half())


# The GGML types kept quantized: name -> (weights per block, bytes per block, the reader of a weight's blocks
# viewed as [N, K / weights per block, bytes per block])
GGUF_BLOCKS = {"Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q8_0": (32, 34, _q8_0)}


def gguf_weight(
    type_name: str, blocks: torch.Tensor, shape: tuple[int, int]
) -> "QuantizedTensor | torch.Tensor":
    """A GGUF weight as a QuantizedTensor where a kernel keeps its type, else dequantized to float32 [N, K] by
    the gguf package (the caller logs what that cost)."""
    quantized = QuantizedTensor.from_gguf_blocks(type_name, blocks, shape)
    if quantized is not None:
        return quantized
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(blocks.numpy(), GGMLQuantizationType[type_name])
    except (KeyError, NotImplementedError):
        raise ValueError(f"GGML type {type_name} can be neither kept quantized nor dequantized") from None
    return torch.from_numpy(values.astype("float32", copy=False)).reshape(shape)


class QuantizedLinear:
    """The LinearMethod for quantized weights. A layer whose checkpoint weight is quantized (layer.quantized)
    keeps it so; with `bits` set, dense weights are quantized at load to that many bits (the LM head and
    embedding to 8). Any other dense weight runs through `dense`, the method it would have had.

    The kernel takes bfloat16 activations and accumulates in float32; each row's sums run in a fixed order,
    so a token's result is the same in any batch without padding."""

    keeps_quantized = True

    def __init__(self, kernels, dense, bits: int | None = None):
        self.kernels = kernels  # the compiled module (model/kernels.py)
        self.dense = dense
        self.bits = bits

    def prepare(self, layer) -> None:
        source = layer.quantized
        if source is None and self.bits is not None:
            bits = 8 if layer.reads_rows else self.bits  # the [vocab, hidden] matrix stays finer
            source = QuantizedTensor.quantize(layer.weight, bits)
        layer.bits = None if source is None else source.bits
        if source is None:
            return self.dense.prepare(layer)
        packed = source.pack()
        for name, tensor in packed.items():  # CPU only: the kernel is kvserve's CPU kernel
            layer.register_buffer(name, tensor, persistent=False)
        bias = layer.bias.float() if layer.bias is not None else None
        # The kernel's arguments after x, as one plain tuple: read once per GEMM, where the buffers above (and
        # a missing attribute) each cost a trip through nn.Module.__getattr__, ~0.4 ms of a 1-row step.
        layer.gemm_args = (*packed.values(), bias, layer.out_features)
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, device="meta"), requires_grad=False)
        layer.quantized = None

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.bits is None:
            return self.dense.apply(layer, x)
        return self._gemm(layer, x, float_out=False)

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if layer.bits is None:
            return self.dense.rows(layer, ids)
        K = layer.in_features
        if layer.bits == 4:
            return self.kernels.q4_rows(layer.packed, layer.scales, layer.mins, ids, K)
        return self.kernels.q8_rows(layer.packed, layer.scales, ids, K)

    def logits(self, layer, x: torch.Tensor) -> torch.Tensor:
        """float32 outputs of the exact weights: no near-tie recompute is needed."""
        if layer.bits is None:
            return self.dense.logits(layer, x)
        return self._gemm(layer, x, float_out=True)

    def _gemm(self, layer, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        gemm = self.kernels.q4_gemm if layer.bits == 4 else self.kernels.q8_gemm
        return gemm(x, *layer.gemm_args, float_out)  # (packed, scales[, mins], bias, N)
