"""A sparse layer's experts on a GPU: one Triton kernel for each of the layer's two GEMMs over all its experts.

PyTorch's loop over experts (model/moe.py) reads each expert's token count back to the host and launches a few
kernels per chosen expert: a host wait in every sparse layer, ~50 launches a layer for a Qwen3-30B-A3B token, and a
step no CUDA graph can hold. Here the step's (token, expert) pairs are sorted by expert on the device (argsort,
counts by scatter-add, block offsets by cumsum and searchsorted: no value read back), each expert's pairs padded to
whole tiles of BLOCK_M rows, and one grouped GEMM runs every tile: a program reads its tile's expert's weight
columns once for all of that tile's rows. The up projection gathers its rows from the tokens; the activation is the
MLP's own (PyTorch ops on all pairs at once); the down projection scales each pair by its routing weight and
writes it in the pair's place, so a token's k outputs are summed by a view. The experts' weights are stacked
[experts, out, in] once at load, each expert's Linear then viewing its slice (no second copy): dense, or a GGUF's
quantized blocks as model/linear_triton.py keeps them on the device, each tile dequantized as it is read by that
module's weight_tile (a fused gate | up of two formats is two runs of columns, one launch each).

On a CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it.
"""

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from model.linear_triton import DeviceSegment, dot_dtype, register_segments, weight_tile

log = logging.getLogger(__name__)

# the kernel's largest error against the loop over experts (relative to the outputs' largest value) it may have
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}


@triton.jit
def _grouped_gemm(
    a_ptr,  # [rows, K]
    w_ptr, scale_ptr, min_ptr, super_ptr, super_min_ptr, levels_ptr,  # w [E, N, K] dense (the rest unread), or
    # quantized: q and its scales [E, N, ...], each expert's as model/linear_triton.py's weight_tile reads them
    bias_ptr, pair_scale_ptr, out_ptr,  # bias [E, N], pair_scale [P], out [P, N]
    order_ptr, tile_expert_ptr, first_pair_ptr, counts_ptr, first_tile_ptr, num_tiles_ptr,
    N, K, stride_a, stride_we, stride_wn, stride_se, stride_sse, stride_be, stride_out,
    PAIRS_PER_ROW: tl.constexpr,  # pairs that read one row of a: top k (rows are tokens), or 1 (rows are pairs)
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BITS: tl.constexpr,  # 0: dense weights; else the quantized format, with the four below (weight_tile's)
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_SUPER: tl.constexpr,
    LEVELS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # quantized: divides K and, with super-blocks, 256
    DOT: tl.constexpr,  # the dots' input dtype
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):  # the grid is sized for the most tiles a step of this size can have
        return
    e = tl.load(tile_expert_ptr + tile)
    first, count = tl.load(first_pair_ptr + e), tl.load(counts_ptr + e)
    # the tile's rows: its expert's pairs, in the expert-sorted order, from this tile's first
    s = first + (tile - tl.load(first_tile_ptr + e)) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = s < first + count
    pair = tl.load(order_ptr + s, mask=real, other=0)
    row = pair // PAIRS_PER_ROW
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < K
        a = tl.load(
            a_ptr + row[:, None] * stride_a + k[None, :], mask=real[:, None] & in_k[None, :], other=0.0
        )
        if BITS == 0:
            w = tl.load(
                w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :],
                mask=in_n[:, None] & in_k[None, :],
                other=0.0,
            )
        else:  # the expert's weight read quantized, dequantized tile by tile
            w = weight_tile(
                w_ptr + e * stride_we, scale_ptr + e * stride_se, min_ptr + e * stride_se,
                super_ptr + e * stride_sse, super_min_ptr + e * stride_sse, levels_ptr, n, in_n, k0, K,
                BITS, GROUP, HAS_MIN, HAS_SUPER, LEVELS, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        acc += tl.dot(a.to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc *= tl.load(pair_scale_ptr + pair, mask=real, other=0.0)[:, None]
    tl.store(
        out_ptr + pair[:, None] * stride_out + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=real[:, None] & in_n[None, :],
    )


class Plan:
    """A step's (token, expert) pairs (pair p = token * k + j: the token's j-th choice) sorted by expert on the
    device, and the tiles of BLOCK_M pairs the kernel runs: each expert's pairs padded to whole tiles."""

    def __init__(self, ids: torch.Tensor, num_experts: int, block_m: int):
        flat = ids.flatten()
        P = flat.numel()
        self.order = flat.argsort(stable=True)  # pairs, by expert
        counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        self.counts = counts
        self.first_pair = counts.cumsum(0) - counts  # each expert's first pair in `order`
        tiles = (counts + block_m - 1) // block_m
        last_tile = tiles.cumsum(0)
        self.first_tile = last_tile - tiles
        self.num_tiles = last_tile[-1:]
        # at most P // block_m + one part-filled tile per expert that has a pair: the grid, known on the host
        self.grid_tiles = P // block_m + min(num_experts, P) + 1
        tile_ids = torch.arange(self.grid_tiles, device=ids.device)
        self.tile_expert = torch.searchsorted(last_tile, tile_ids, right=True).clamp_(max=num_experts - 1)
        self.block_m, self.pairs = block_m, P


@dataclass
class Projection:
    """One of the experts' two GEMMs, every expert's weight at once: runs of output columns, each [experts, n, K],
    dense (one run) or quantized as model/linear_triton.py keeps a GGUF's weights on the device (a run per format:
    DeviceSegment.stack), and the biases [experts, N]."""

    runs: list[torch.Tensor | DeviceSegment]
    bias: torch.Tensor | None

    def shapes(self) -> list[tuple[int, int]]:
        """Each run's (n, K)."""
        return [tuple(r.shape[1:]) if isinstance(r, torch.Tensor) else (r.n, r.k) for r in self.runs]

    def key(self) -> tuple:
        """What the kernel is compiled and checked for: each run's shape and dtype or format, and the biases."""
        kinds = [r.dtype if isinstance(r, torch.Tensor) else r.quantized.format for r in self.runs]
        return (*self.shapes(), *kinds, self.bias is not None)


def grouped_gemm(
    a: torch.Tensor,  # [rows, K]: the tokens (pairs_per_row = k) or the pairs (1)
    w: Projection,
    plan: Plan,
    pairs_per_row: int,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None = None,  # [pairs] float32: each pair's output times this
) -> torch.Tensor:  # [pairs, N]: pair p's row a[p // pairs_per_row] times its expert's weight
    a = a.contiguous()  # the kernel steps over a row's K elements one by one
    shapes = w.shapes()
    out = torch.empty(plan.pairs, sum(n for n, _ in shapes), dtype=out_dtype, device=a.device)
    dot = dot_dtype(a)
    block_n = 64
    n0 = 0
    for run, (n, K) in zip(w.runs, shapes, strict=True):
        if isinstance(run, torch.Tensor):
            tensors, block_k = [run] * 6, 64
            format_ = dict(BITS=0, GROUP=1, HAS_MIN=False, HAS_SUPER=False, LEVELS=False)
            strides = (run.stride(0), run.stride(1), 0, 0)
        else:
            tensors, format_ = run.weight_args()
            q, scales, _, supers = tensors[:4]
            strides, block_k = (q.stride(0), 0, scales.stride(0), supers.stride(0)), run.block_k()
        bias = None if w.bias is None else w.bias[:, n0 : n0 + n]
        _grouped_gemm[(plan.grid_tiles, triton.cdiv(n, block_n))](
            a, *tensors, bias if bias is not None else out, scale if scale is not None else out, out[:, n0:],
            plan.order, plan.tile_expert, plan.first_pair, plan.counts, plan.first_tile, plan.num_tiles,
            n, K, a.stride(0), *strides, 0 if bias is None else bias.stride(0), out.stride(0),
            PAIRS_PER_ROW=pairs_per_row, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, **format_,
            BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
            PRECISION="ieee" if dot == tl.float32 else "tf32",
        )  # fmt: skip
        n0 += n
    return out


class GroupedExperts:
    """A sparse layer's experts (model/moe.py's MLPs) as the two grouped GEMMs above."""

    def __init__(self, experts: nn.ModuleList, dtype: torch.dtype):
        """dtype: the activations'."""
        self.activation = experts[0].activation  # every expert's kind is the model's
        self.num_experts, self.dtype = len(experts), dtype
        self.up = _stack([e.up for e in experts])
        self.down = _stack([e.down for e in experts])

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] float32: sum over each token's k experts (ids [T, k]) of weight * expert(x)."""
        T, k = ids.shape
        # a tile's rows share one read of the expert's weight: 16 (the dots' smallest) unless experts average more
        block_m = 64 if T * k >= 64 * self.num_experts else 16
        plan = Plan(ids, self.num_experts, block_m)
        h = grouped_gemm(x, self.up, plan, k, x.dtype)  # [T * k, up]
        y = grouped_gemm(self.activation(h), self.down, plan, 1, torch.float32, weights.flatten().float())
        return y.view(T, k, -1).sum(1)


def _stack(linears: list) -> Projection:
    """The layers' weights as one [experts, out, in] tensor per run (and biases [experts, out]), each layer's then
    a view of its slice: the stacked copy is the only one."""
    bias = None
    if linears[0].bias is not None:
        bias = torch.stack([linear.bias.detach() for linear in linears])
        for i, linear in enumerate(linears):
            linear.bias = nn.Parameter(bias[i], requires_grad=False)
    if getattr(linears[0], "bits", None) is not None:  # quantized on the device (model/linear_triton.py)
        runs = [DeviceSegment.stack([linear.segments[j] for linear in linears])
                for j in range(len(linears[0].segments))]  # fmt: skip
        for linear in linears:
            register_segments(linear)
        return Projection(runs, bias)
    weight = torch.stack([linear.weight.detach() for linear in linears])
    for i, linear in enumerate(linears):
        linear.weight = nn.Parameter(weight[i], requires_grad=False)
    return Projection([weight], bias)


def why_not_grouped(experts: nn.ModuleList) -> str | None:
    """Why the kernel cannot read these experts' weights as they are, or None: each projection dense in every
    expert, or quantized on the device in the same formats and shapes in every expert (a GGUF's 3-D tensor)."""
    for name in ("up", "down"):
        linears = [getattr(e, name) for e in experts]
        if all(getattr(linear, "bits", None) is None and not linear.weight.is_meta for linear in linears):
            continue
        # each layer's runs of rows on the device: () for a dense one, or one quantized for the CPU's kernels
        layouts = {
            tuple((s.quantized.format, s.n, s.k) for s in getattr(linear, "segments", ()))
            for linear in linears
        }
        if len(layouts) != 1 or () in layouts:
            return f"their {name} projections are not all dense, nor all quantized alike on the device"
    return None


def grouped_experts(experts: nn.ModuleList) -> GroupedExperts | None:
    """The layer's experts as grouped GEMMs, where the kernel computes on this device what the loop over experts
    does (checked once per shape, format and dtype, on a step of a few tokens); else None, logged with why: the
    loop."""
    why_not = why_not_grouped(experts)
    if why_not is not None:
        if why_not not in _said:  # once, not for every layer
            log.warning("MoE experts: PyTorch's loop over experts (%s)", why_not)
            _said.add(why_not)
        return None
    first = experts[0].down  # the activations' dtype: a dense weight's, or the one the quantized GEMM runs in
    dtype = first.weight.dtype if getattr(first, "bits", None) is None else first.method.dtype
    grouped = GroupedExperts(experts, dtype)
    key = (*grouped.up.key(), *grouped.down.key(), dtype, _device(grouped.up))
    if key not in _works:
        _works[key] = _check(grouped, experts)
    return grouped if _works[key] else None


def _device(w: Projection) -> torch.device:
    run = w.runs[0]
    return run.device if isinstance(run, torch.Tensor) else run.quantized.q.device


_works: dict[tuple, bool] = {}  # (shapes, formats, dtype, device) -> whether the kernel is right here
_said: set[str] = set()  # why experts could not be grouped, logged


def _check(grouped: GroupedExperts, experts: nn.ModuleList) -> bool:
    g = torch.Generator().manual_seed(0)
    E, k = grouped.num_experts, min(2, grouped.num_experts)
    hidden = grouped.up.shapes()[0][1]
    T = 5
    device = _device(grouped.up)
    x = torch.randn(T, hidden, generator=g).to(device, grouped.dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    weights = torch.rand(T, k, generator=g).to(device)
    try:
        ours = grouped(x, weights, ids)
    except Exception as e:  # no Triton, or a kernel this device's compiler refuses: the loop all the same
        log.warning("MoE experts: PyTorch's loop over experts (the grouped kernel could not run: %s: %s)",
                    type(e).__name__, e)  # fmt: skip
        return False
    loop = torch.zeros_like(ours)
    for t in range(T):
        for j in range(k):
            loop[t] += experts[int(ids[t, j])](x[t : t + 1])[0].float() * weights[t, j]
    error = ((ours - loop).abs().max() / loop.abs().max()).item()
    if error > TOLERANCE[x.dtype]:
        log.warning(
            "MoE experts: PyTorch's loop over experts (the grouped kernel is off by %.2g here)", error
        )
        return False
    log.info("MoE experts: kvserve's grouped Triton GEMMs, the step's tokens sorted by expert on the device")
    return True
