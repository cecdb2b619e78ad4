"""Quantized weights on a GPU, kept quantized: a Triton GEMM that dequantizes each tile of the weight as it reads it.

A GGUF file's weights (model/gguf_blocks.py's QuantizedTensor: exact integers q and per-group scales, whatever the
block format) go onto the GPU once, at load, as the kernel reads them: 4-bit q two to a byte (q[2i] in the low
nibble, q[2i + 1] in the high), 5-, 6- and 8-bit q a byte each; each group's scale and minimum as the file
gives them (float16, or int8 sub-scales times a float16 per super-block of 256). A Q4_K weight is then 4.6 bits
a weight where bfloat16 is 16: a Q4_K_M file's decode step reads ~3x fewer bytes than its dequantized weights. Each program of the kernel
computes a [BLOCK_M, BLOCK_N] tile of y = x W^T: per step along K it loads BLOCK_K of x's columns and the
matching [BLOCK_N, BLOCK_K] q, scales them to w = d q + m in float32 (the values `QuantizedTensor.dequantize`
gives, rounded once to the dot's dtype, as the dequantized-at-load weights were) and multiplies on the tensor
cores, accumulating in float32. 5- and 6-bit q a byte each cost more than the file's bytes (Q5_K 1.6x, Q6_K
1.3x): their bit planes are not repacked.

On a CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check every
format without a GPU; there its dots take float32 (the interpreter multiplies 16-bit dots wrongly).
"""

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from model.quant import SUPER, QuantizedTensor, take_quantized

log = logging.getLogger(__name__)

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(x: torch.Tensor):
    """The dtype a kernel's tl.dot takes for inputs like x: x's own on a GPU (its tensor cores); float32 under
    Triton's interpreter on a CPU, which multiplies 16-bit dots wrongly (numpy has no bfloat16)."""
    return TL_DTYPES[x.dtype] if x.device.type != "cpu" else tl.float32


# the start check's largest error against F.linear on the same dequantized weights, relative to the largest output:
# the same products summed in another order (float32 sums), with room; a miscompiled kernel is off by ~1
GEMM_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
MIN_ROWS = 16  # tl.dot's smallest tile: a decode step's few rows run in a tile of 16
# A decode step's GEMM splits K until it runs about this many programs (~4 per SM of an H100 or H200): a [2048,
# 2048] weight in tiles of 32 outputs is 64 programs, which would leave half the SMs idle and the rest waiting on
# one stream of loads each. The splits' float32 partial sums are added in a fixed order after (deterministic).
TARGET_PROGRAMS = 512
MIN_SPLIT_STEPS = 4  # steps along K a split runs at least
SUPER_K = tl.constexpr(
    SUPER
)  # weights per super-block along K (a global the kernel reads must be a constexpr)


@triton.jit
def weight_tile(
    q_ptr, scale_ptr, min_ptr, super_ptr, super_min_ptr, levels_ptr,  # one [N, K] weight's tensors
    cols, col_ok, k0, K,  # the tile: its columns (the weight's rows) and K from k0
    BITS: tl.constexpr,  # 4 (two q a byte), 5, 6 (a byte each, 0 .. 2^BITS - 1) or 8 (int8)
    GROUP: tl.constexpr,  # weights per scale along K (32, or 16: Q6_K)
    HAS_MIN: tl.constexpr,  # w = d q + m, else d q
    HAS_SUPER: tl.constexpr,  # d and m: int8 per group times float16 per super-block of 256
    LEVELS: tl.constexpr,  # q indexes a table of 16 levels (IQ4_NL, IQ4_XS, MXFP4)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K and, with super-blocks, 256
):  # fmt: skip
    """float32 [BLOCK_N, BLOCK_K]: the weight's rows `cols`, K from k0, dequantized (0 outside col_ok)."""
    if BITS == 4:
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(q_ptr + cols[:, None] * (K // 2) + pairs[None, :], mask=col_ok[:, None], other=0)
        q = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_N, BLOCK_K])  # q[2i], q[2i + 1]
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + cols[:, None] * K + ks[None, :], mask=col_ok[:, None], other=0)
    if LEVELS:
        w = tl.load(levels_ptr + q.to(tl.int32)).to(tl.float32)
    else:
        w = q.to(tl.float32)
    # the tile's groups: d and m per [column, group], each over its GROUP weights
    gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    at = cols[:, None] * (K // GROUP) + gs[None, :]
    d = tl.load(scale_ptr + at, mask=col_ok[:, None], other=0).to(tl.float32)
    if HAS_SUPER:  # the tile lies in one super-block
        s = cols * (K // SUPER_K) + k0 // SUPER_K
        d = d * tl.load(super_ptr + s, mask=col_ok, other=0).to(tl.float32)[:, None]
    w = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // GROUP, GROUP]) * d[:, :, None], [BLOCK_N, BLOCK_K])
    if HAS_MIN:
        m = tl.load(min_ptr + at, mask=col_ok[:, None], other=0).to(tl.float32)
        if HAS_SUPER:
            m = m * tl.load(super_min_ptr + s, mask=col_ok, other=0).to(tl.float32)[:, None]
        w = tl.reshape(tl.reshape(w, [BLOCK_N, BLOCK_K // GROUP, GROUP]) + m[:, :, None], [BLOCK_N, BLOCK_K])
    return w


@triton.jit
def _quant_gemm(
    x_ptr, q_ptr, scale_ptr, min_ptr, super_ptr, super_min_ptr, levels_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, stride_ys, k_per_split,  # y [splits, M, N]: each split's partial sums
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_SUPER: tl.constexpr,
    LEVELS: tl.constexpr,  # (these five: the weight's format, as weight_tile reads it)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K and, with super-blocks, 256
    DOT: tl.constexpr,  # the dot's input dtype
    PRECISION: tl.constexpr,  # "ieee" for float32 dots (no TF32)
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = tl.program_id(2) * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0)
        w = weight_tile(
            q_ptr, scale_ptr, min_ptr, super_ptr, super_min_ptr, levels_ptr, cols, col_ok, k0, K,
            BITS, GROUP, HAS_MIN, HAS_SUPER, LEVELS, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc += tl.dot(x.to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + tl.program_id(2) * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass
class DeviceSegment:
    """One run of a layer's rows in one format (a fused layer's Q4_K q/k and Q6_K v are two), on the device as
    the kernel reads it. `quantized` keeps the scales' tensors and, for 4 bits, q two to a byte."""

    quantized: QuantizedTensor  # its q: [n, k / 2] uint8 for 4 bits (q[2i] | q[2i + 1] << 4), else [n, k]
    n: int
    k: int
    levels: torch.Tensor | None  # float32 [16]: what q stands for (4 bits without a minimum)

    @classmethod
    def create(cls, t: QuantizedTensor, device: torch.device) -> "DeviceSegment":
        n, k = t.shape
        q = t.q
        if t.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        fields = {"q": q, "scale": t.scale, "min": t.min, "supers": t.supers, "super_mins": t.super_mins}
        moved = {name: None if v is None else v.to(device).contiguous() for name, v in fields.items()}
        if t.min is t.scale:  # Q6_K's minimum shares the scale's sub-scales: one tensor
            moved["min"] = moved["scale"]
        on_device = QuantizedTensor(t.bits, **moved, group=t.group, kind=t.kind, levels=t.levels)
        levels = t.level_table
        table = None if levels is None else torch.tensor(levels, dtype=torch.float32, device=device)
        return cls(on_device, n, k, table)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors on the device, by name (a shared one once)."""
        t = self.quantized
        named = {"q": t.q, "scale": t.scale, "min": t.min, "supers": t.supers, "super_mins": t.super_mins,
                 "levels": self.levels}  # fmt: skip
        if t.min is t.scale:
            del named["min"]
        return {name: v for name, v in named.items() if v is not None}

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), k]: rows of the exact weights (an embedding's lookups), on the device, without a
        host copy (a decode step's lookups run inside its CUDA graph)."""
        rows = self.quantized.select_rows(ids)
        if rows.bits == 4:
            rows.q = torch.stack([rows.q & 15, rows.q >> 4], dim=-1).flatten(-2)
        return rows.dequantize(self.levels)

    @classmethod
    def stack(cls, segments: list["DeviceSegment"]) -> "DeviceSegment":
        """The same run of rows of several weights (a sparse layer's experts: one format and shape) as one
        segment whose tensors lead with the weight, [len(segments), n, ...]; each of `segments` then views its
        slice, so the stack is the only copy (register_segments re-registers a layer's buffers)."""
        first = segments[0].quantized
        stacked = {}
        for name in ("q", "scale", "min", "supers", "super_mins"):
            if getattr(first, name) is not None and not (name == "min" and first.min is first.scale):
                stacked[name] = torch.stack([getattr(s.quantized, name) for s in segments])
        if first.min is first.scale:
            stacked["min"] = stacked["scale"]
        for i, segment in enumerate(segments):
            views = {name: v[i] for name, v in stacked.items()}
            if first.min is first.scale:
                views["min"] = views["scale"]
            segment.quantized = dataclasses.replace(segment.quantized, **views)
        return cls(dataclasses.replace(first, **stacked), segments[0].n, segments[0].k, segments[0].levels)

    def weight_args(self) -> tuple[list[torch.Tensor], dict]:
        """What weight_tile reads of it: its tensors (q, scale, min, super-scales, super-minimums, levels; the
        scale where it has none, never read) and its format's constants."""
        t = self.quantized
        tensors = [t.q, t.scale, t.min, t.supers, t.super_mins, self.levels]
        format_ = dict(BITS=t.bits, GROUP=t.group, HAS_MIN=t.min is not None, HAS_SUPER=t.supers is not None,
                       LEVELS=self.levels is not None)  # fmt: skip
        return [t.scale if v is None else v for v in tensors], format_

    def block_k(self) -> int:
        """The kernel's step along K: 64 where it divides K (and so 256), else the group."""
        return 64 if self.k % 64 == 0 else self.quantized.group

    def gemm(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> None:
        """y = x W^T (+ bias), into y [M, n] (a view of the layer's output: its columns of a fused layer)."""
        M = x.shape[0]
        dot = dot_dtype(x)
        # a decode step's few rows: narrow tiles and K split (a GEMV reads the weight once, spread over the GPU's
        # SMs); a prefill's: square tiles of 64 (each weight tile dequantized once per 64 rows)
        decode = M <= MIN_ROWS
        block_m, block_n = (MIN_ROWS, 32) if decode else (64, 64)
        block_k = self.block_k()
        grid_mn = (triton.cdiv(M, block_m), triton.cdiv(self.n, block_n))
        steps = self.k // block_k
        splits = 1
        if decode:
            splits = max(1, min(steps // MIN_SPLIT_STEPS, TARGET_PROGRAMS // (grid_mn[0] * grid_mn[1])))
        k_per_split = triton.cdiv(steps, splits) * block_k
        splits = triton.cdiv(self.k, k_per_split)
        out = y if splits == 1 else torch.empty(splits, M, self.n, dtype=torch.float32, device=x.device)
        tensors, format_ = self.weight_args()
        _quant_gemm[(*grid_mn, splits)](
            x, *tensors, bias if bias is not None else y, out,
            M, self.n, self.k, x.stride(0), out.stride(-2), out.stride(0) if splits > 1 else 0, k_per_split,
            **format_, HAS_BIAS=bias is not None and splits == 1, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, DOT=dot, PRECISION="ieee" if dot == tl.float32 else "tf32",
        )  # fmt: skip
        if splits > 1:
            total = out.sum(0)
            if bias is not None:
                total += bias.float()
            y.copy_(total)


class TritonQuantLinear:
    """The LinearMethod for quantized weights on a GPU (model/linear.py's seam): a layer whose checkpoint weight is
    quantized keeps it so, on the device, multiplied by the Triton kernel above; with `bits` set, dense weights
    are quantized at load to that many bits (the embedding to 8), as model/quant.py's QuantizedLinear does on the
    CPU. Any other weight runs through `dense`. The first weight of each format is checked against its
    dequantized F.linear on the device (error_against_dequantized): a format the kernel gets wrong here (a
    Triton build that miscompiles it) is served dequantized to `dtype`, with a warning."""

    keeps_quantized = True

    def __init__(self, device: torch.device, dtype: torch.dtype, dense, bits: int | None = None):
        self.device, self.dtype = device, dtype
        self.dense = dense
        self.bits = bits
        self.works: dict[tuple, bool] = {}  # format -> whether the kernel computes it right here

    def prepare(self, layer) -> None:
        segments = take_quantized(layer, self.bits)
        if segments is None:
            return self.dense.prepare(layer)
        if not all(self._works(s) for s in segments):
            weight = torch.cat([s.dequantize() for s in segments]).to(self.device, self.dtype)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.bits = None
            return self.dense.prepare(layer)
        layer.segments = [DeviceSegment.create(s, self.device) for s in segments]
        register_segments(layer)
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, device="meta"), requires_grad=False)

    def _works(self, t: QuantizedTensor) -> bool:
        if t.format not in self.works:
            sample = t.select_rows(torch.arange(min(64, t.shape[0])))  # the weight's own values, a few rows
            try:
                error = error_against_dequantized(sample, self.device, self.dtype)
                why_not = None if error <= GEMM_TOLERANCE[self.dtype] else f"is off by {error:.2g} here"
            except Exception as e:  # a kernel this device's compiler refuses
                why_not = f"could not run: {type(e).__name__}: {e}"
            if why_not is not None:
                log.warning("%s weights served dequantized to %s (kvserve's Triton GEMM %s)", t.kind,
                            str(self.dtype).removeprefix("torch."), why_not)  # fmt: skip
            self.works[t.format] = why_not is None
        return self.works[t.format]

    def apply(self, layer, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if layer.bits is None:
            return self.dense.apply(layer, x)
        x = x.contiguous()
        y = torch.empty(x.shape[0], layer.out_features, dtype=out_dtype or x.dtype, device=x.device)
        n0 = 0
        for segment in layer.segments:
            bias = None if layer.bias is None else layer.bias[n0 : n0 + segment.n]
            segment.gemm(x, y[:, n0 : n0 + segment.n], bias)
            n0 += segment.n
        return y

    def rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        if layer.bits is None:
            return self.dense.rows(layer, ids)
        (embedding,) = layer.segments  # rows are an embedding's lookups: one tensor, never a fused layer's
        return embedding.dequantize_rows(ids)

    def logits(self, layer, x: torch.Tensor) -> torch.Tensor:
        """float32 outputs of the exact weights (the kernel's float32 sums, not rounded to the model's dtype)."""
        if layer.bits is None:
            return self.dense.logits(layer, x)
        return self.apply(layer, x, torch.float32)


def register_segments(layer) -> None:
    """The layer's segments' tensors as its buffers too: what counts a module's bytes sees them."""
    for i, segment in enumerate(layer.segments):
        for name, tensor in segment.tensors().items():
            layer.register_buffer(f"{name}_{i}", tensor, persistent=False)


def error_against_dequantized(t: QuantizedTensor, device: torch.device, dtype: torch.dtype) -> float:
    """The kernel's largest error on `t` (a weight of the model's own format) against F.linear on its weights
    dequantized to `dtype`, relative to the largest output, on a decode's rows and a prefill's: the start-time
    check that the Triton build on this device computes what it should."""
    g = torch.Generator().manual_seed(0)
    segment = DeviceSegment.create(t, device)
    w = t.dequantize().to(device, dtype)
    worst = 0.0
    for rows in (3, 70):
        x = torch.randn(rows, segment.k, generator=g).to(device, dtype)
        y = torch.empty(rows, segment.n, dtype=torch.float32, device=device)
        segment.gemm(x, y, None)
        want = F.linear(x.float(), w.float())
        worst = max(worst, ((y - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return worst
