"""Quantized weights: GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4), or int4 / int8
made at load, kept quantized in memory and multiplied by kvserve's C++ kernel (model/csrc/quant_gemm.cpp).

A QuantizedTensor holds a weight's exact integers and per-group scales, in a plain [N, K] form that the loader
can fuse (q/k/v, gate/up) and quantize into. It is made from a GGUF tensor's raw block rows, however they come:
read in place from the GGUF file (weights/gguf_source.py) or from quantized/model.safetensors, where
`kvserve convert-gguf` keeps them (weights/gguf_convert.py); model/gguf_blocks.py is the one place that reads a
block format. QuantizedLinear, the weight format of model/linear.py's seam, packs it into the kernel's layout
once, at load. Any other GGML type is dequantized at load (gguf_blocks.gguf_weight) and runs through the dense
method.
"""

from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32  # weights per scale, along K (16 for Q6_K)
SUPER = 256  # weights per super-block (K-quants, IQ4_XS), along K
TILE = 16  # output rows per tile of the packed layout
# a sub-folder: tools that read every top-level *.safetensors skip it. weights/gguf_convert.py writes it: each
# quantized weight W [N, K] as its raw GGML block rows "W" (uint8 [N, bytes per row], read by model/gguf_blocks.py),
# its type and shape in the metadata; folders converted before (format kvserve-quantized-1) hold "W.q4" uint8
# [N, K / 2] (q[2i] | q[2i + 1] << 4) or "W.q8" int8 [N, K], "W.scale" and (4 bits) "W.min" float16 [N, K / 32]
# (from_parts)
QUANTIZED_FILE = "quantized/model.safetensors"
# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h kvalues_iq4nl): what a 4-bit q without a minimum stands for
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's 16 E2M1 values doubled (ggml-common.h kvalues_mxfp4): 0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives,
# times 2, its scale halved to match (model/gguf_blocks.py)
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass
class QuantizedTensor:
    """[N, K] weights in groups of `group` (32, or 16) along K, w = d * q + m per group: q in 0 .. 2^bits - 1
    (bits 4, 5, 6: with a minimum), levels[q] (bits 4 without one: IQ4_LEVELS for IQ4_NL and IQ4_XS,
    MXFP4_LEVELS for MXFP4) or -128..127 (bits 8).
    d and m are float16 per group (`scale`, `min`), or, where `supers` is set (K-quants, IQ4_XS), int8 sub-scales
    and sub-minimums per group times a float16 scale and minimum per super-block of 256 (`supers`, `super_mins`:
    the file's d and -dmin), whose products are exact in float32.

    Resident bits per weight once packed (q, the group's scale and minimum, the super-block's): Q4_0, Q4_1 5.0
    (4 + 2 x 16 / 32); Q4_K 4.5 (4 + 2 x 6 / 32 + 2 x 16 / 256); Q5_0, Q5_1 6.0; Q5_K 5.5; Q6_K 6.625 (6 +
    8 / 16 + 2 x 16 / 256: its minimum, -32 d sc, shares the scale's sub-scale); Q8_0 8.5; IQ4_NL 4.5; IQ4_XS
    4.3125; MXFP4 4.5. The file's: 4.5, 5.0, 4.5, 5.5, 6.0, 5.5, 6.5625, 8.5, 4.5, 4.25, 4.25.
    A minimum may be the scale's own tensor (`min is scale`, Q6_K): packed once. `kind` names the file's type."""

    bits: int
    q: torch.Tensor  # [N, K] uint8 (4 bits) or int8
    scale: torch.Tensor  # [N, K / group] float16, or int8 sub-scales (with supers)
    # [N, K / group] float16, or int8 sub-minimums (with supers); 4 bits always
    min: torch.Tensor | None = None
    supers: torch.Tensor | None = None  # [N, K / 256] float16: the super-block's d
    super_mins: torch.Tensor | None = None  # [N, K / 256] float16: the super-block's minimum scale (-dmin)
    group: int = GROUP
    kind: str = ""
    levels: tuple[int, ...] = IQ4_LEVELS  # what q stands for, 4 bits without a minimum

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def format(self) -> tuple:
        """What the kernel must know to multiply it: tensors of one format can be fused by rows."""
        return (self.bits, self.group, self.min is not None, self.supers is not None, self.level_table)

    @property
    def level_table(self) -> tuple[int, ...] | None:
        """The levels q indexes (4 bits without a minimum), else None: q is the integer."""
        return self.levels if self.bits == 4 and self.min is None else None

    def scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 d and m per group, [N, K / group] each (m None without a minimum): exact."""
        d = self.scale.float()
        m = None if self.min is None else self.min.float()
        if self.supers is not None:
            per = SUPER // self.group
            d = d * self.supers.float().repeat_interleave(per, dim=1)
            if m is not None:
                m = m * self.super_mins.float().repeat_interleave(per, dim=1)
        return d, m

    def dequantize(self, levels: torch.Tensor | None = None) -> torch.Tensor:
        """The exact weights, float32 [N, K] (d * q, then + m: two roundings, as the kernel's rows). levels: the
        level table on q's device, where one is there already (a GPU step makes none: no copy inside a graph)."""
        N, K = self.shape
        d, m = self.scales()
        q = self.q
        if self.level_table:  # q indexes the levels
            if levels is None:
                levels = torch.tensor(self.level_table, dtype=torch.int8, device=q.device)
            q = levels[q.long()]
        w = q.view(N, K // self.group, self.group).float() * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.view(N, K)

    def _per_row(self) -> dict[str, torch.Tensor | None]:
        return {"q": self.q, "scale": self.scale, "min": self.min, "supers": self.supers,
                "super_mins": self.super_mins}  # fmt: skip

    def _shared(self, rows: dict) -> dict:  # a minimum that is the scale's own tensor stays so
        if self.min is self.scale:
            rows["min"] = rows["scale"]
        return rows

    def select_rows(self, index: torch.Tensor) -> "QuantizedTensor":
        rows = {k: None if v is None else v[index] for k, v in self._per_row().items()}
        return QuantizedTensor(
            self.bits, **self._shared(rows), group=self.group, kind=self.kind, levels=self.levels
        )

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """Rows of several weights of one format one after the other (fused q/k/v, gate/up)."""
        if len({p.format for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different formats")
        rows = {
            k: None if v is None else torch.cat([p._per_row()[k] for p in parts])
            for k, v in parts[0]._per_row().items()
        }
        kind = "+".join(dict.fromkeys(p.kind for p in parts))
        if all(p.min is p.scale for p in parts):
            rows = parts[0]._shared(rows)
        return QuantizedTensor(parts[0].bits, **rows, group=parts[0].group, kind=kind, levels=parts[0].levels)

    @staticmethod
    def segments(parts: list["QuantizedTensor"]) -> list["QuantizedTensor"]:
        """Parts fused by rows: one tensor per run of parts of one format (a Q4_K_M file's attn_v is Q6_K on
        some layers, its q and k Q4_K), each kept in its own format."""
        runs: list[list[QuantizedTensor]] = []
        for p in parts:
            if runs and runs[-1][-1].format == p.format:
                runs[-1].append(p)
            else:
                runs.append([p])
        return [QuantizedTensor.cat(run) for run in runs]

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
            return QuantizedTensor(8, q.view(N, K), scale, kind="int8")
        if bits == 4:
            lo = w.amin(-1).half()
            scale = ((w.amax(-1) - lo.float()) / 15).half()
            step = torch.where(scale > 0, scale.float(), 1)[..., None]
            q = torch.round((w - lo.float()[..., None]) / step).clamp(0, 15)
            return QuantizedTensor(4, q.to(torch.uint8).view(N, K), scale, lo, kind="int4")
        raise ValueError(f"cannot quantize to {bits} bits: 4 or 8")

    @staticmethod
    def from_parts(parts: dict[str, torch.Tensor]) -> "QuantizedTensor":
        """From the file's parts of one weight (keys q4 or q8, scale, min)."""
        if "q8" in parts:
            return QuantizedTensor(8, parts["q8"], parts["scale"], kind="Q8_0")
        packed = parts["q4"]  # two 4-bit values per byte, the first in the low nibble
        q = torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)
        return QuantizedTensor(4, q, parts["scale"], parts["min"], kind="Q4_0/Q4_1")

    def pack(self, kernels) -> dict[str, torch.Tensor | None]:
        """The kernel's layout (model/csrc/quant_gemm.h): rows in tiles of 16, padded with zero rows; q packed by
        the compiled module's pack_quant (model/csrc/quant_pack.cpp), the per-group scales here."""
        N, K = self.shape
        pad = -N % TILE
        T = (N + pad) // TILE

        def per_group(x: torch.Tensor | None) -> torch.Tensor | None:  # [N, G] -> [T, G, 16], zero rows added
            if x is None:
                return None
            return torch.nn.functional.pad(x, (0, 0, 0, pad)).view(T, TILE, -1).permute(0, 2, 1).contiguous()

        if self.six_bit_subs:
            scales, mins = self._six_bit_subs()
            scales, mins = per_group(scales), per_group(mins)
        else:
            scales = per_group(self.scale)
            mins = scales if self.min is self.scale else per_group(self.min)
        levels = self.level_table
        return {"packed": kernels.pack_quant(self.q, self.bits, self.group), "scales": scales, "mins": mins,
                "supers": per_group(self.supers), "super_mins": per_group(self.super_mins),
                "levels": None if levels is None else torch.tensor(levels, dtype=torch.int8)}  # fmt: skip

    @property
    def six_bit_subs(self) -> bool:
        """Q4_K's and Q5_K's form: 6-bit sub-scales and sub-minimums (0 .. 63), groups of 32 (Q6_K's are 16,
        IQ4_XS has no minimum)."""
        return self.supers is not None and self.min is not None and self.group == GROUP

    def _six_bit_subs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sub-scales and sub-minimums in the file's 12 bits a group (model/csrc/quant_gemm.h, ScaleForm):
        int8 [N, K / 32] of sc & 15 | (m & 15) << 4, and int32 [N, K / 256] of each super-block's high bits, its
        group i's sc >> 4 at bits 2i, 2i + 1 and m >> 4 at bits 16 + 2i, 17 + 2i."""
        sc, m = self.scale.long(), self.min.long()
        if sc.min() < 0 or sc.max() > 63 or m.min() < 0 or m.max() > 63:
            raise ValueError(f"{self.kind} sub-scales or sub-minimums outside 0 .. 63")
        low = ((sc & 15) | (m & 15) << 4).to(torch.uint8).view(torch.int8)
        per = SUPER // self.group
        shift = 2 * (torch.arange(sc.shape[1]) % per)  # 2i for a super-block's group i
        bits = (sc >> 4) << shift | (m >> 4) << 16 + shift
        high = bits.unflatten(1, (-1, per)).sum(-1)  # disjoint bits: the sum is their or
        return low, high.to(torch.uint32).view(torch.int32)


def take_quantized(layer, bits: int | None) -> list[QuantizedTensor] | None:
    """A layer's weight as the quantized methods keep it, taken from layer.quantized: the checkpoint's quantized
    tensor (or a fused layer's segments, one per format), or, with `bits` set, its dense weight quantized at load to
    that many bits (the [vocab, hidden] matrix, whose rows are read, to 8: it stays finer). Sets layer.bits (None:
    the weight stays dense) and layer.kinds."""
    source = layer.quantized
    layer.quantized = None
    if source is None and bits is not None:
        source = QuantizedTensor.quantize(layer.weight, 8 if layer.reads_rows else bits)
    if source is None:
        layer.bits = None
        return None
    segments = source if isinstance(source, list) else [source]
    layer.bits = segments[0].bits if len(segments) == 1 else "mixed"
    layer.kinds = [s.kind for s in segments]
    return segments


class QuantizedLinear:
    """The LinearMethod for quantized weights. A layer whose checkpoint weight is quantized (layer.quantized: one
    QuantizedTensor, or a fused layer's segments, one per format) keeps it so; with `bits` set, dense weights are
    quantized at load to that many bits (the LM head and embedding to 8). Any other dense weight runs through
    `dense`, the method it would have had.

    The kernel takes bfloat16 activations and accumulates in float32; each row's sums run in a fixed order,
    so a token's result is the same in any batch without padding."""

    keeps_quantized = True

    def __init__(self, kernels, dense, bits: int | None = None, int8_activations: bool = False):
        self.kernels = kernels  # the compiled module (model/kernels.py)
        self.dense = dense
        self.bits = bits
        # activations rounded to int8 where the tier can (kernels.gemm_int8)
        self.int8_activations = int8_activations

    def prepare(self, layer) -> None:
        segments = take_quantized(layer, self.bits)
        if segments is None:
            return self.dense.prepare(layer)
        gemms = []
        for i, segment in enumerate(segments):
            packed = segment.pack(self.kernels)
            for name, tensor in packed.items():  # CPU only: the kernel is kvserve's CPU kernel
                if tensor is not None:
                    layer.register_buffer(name if i == 0 else f"{name}_{i}", tensor, persistent=False)
            gemms.append(self.kernels.QuantSegment(**packed, bits=segment.bits, group=segment.group,
                                                   n=segment.shape[0]))  # fmt: skip
        bias = layer.bias.float() if layer.bias is not None else None
        # The kernel's argument after x, one object read once per GEMM: the buffers above (and a missing
        # attribute) each cost a trip through nn.Module.__getattr__, ~0.4 ms of a 1-row step.
        layer.gemm = self.kernels.QuantGemm(gemms, bias, layer.out_features, self.int8_activations)
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, device="meta"), requires_grad=False)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.bits is None:
            return self.dense.apply(layer, x)
        return self.kernels.quant_gemm(x, layer.gemm, False)

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if layer.bits is None:
            return self.dense.rows(layer, ids)
        return self.kernels.quant_rows(layer.gemm, ids, layer.in_features)

    def logits(self, layer, x: torch.Tensor) -> torch.Tensor:
        """float32 outputs of the exact weights: no near-tie recompute is needed."""
        if layer.bits is None:
            return self.dense.logits(layer, x)
        return self.kernels.quant_gemm(x, layer.gemm, True)
