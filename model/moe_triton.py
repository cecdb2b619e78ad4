"""A sparse layer's experts on a GPU: one Triton kernel for each of the layer's two GEMMs over all its experts.

PyTorch's loop over experts (model/moe.py) reads each expert's token count back to the host and launches a few
kernels per chosen expert: a host wait in every sparse layer, ~50 launches a layer for a Qwen3-30B-A3B token, and a
step no CUDA graph can hold. Here the step's (token, expert) pairs are sorted by expert on the device (argsort,
counts by scatter-add, block offsets by cumsum and searchsorted: no value read back), each expert's pairs padded to
whole tiles of BLOCK_M rows, and one grouped GEMM runs every tile: a program reads its tile's expert's weight
columns once for all of that tile's rows. The up projection gathers its rows from the tokens; the activation is the
MLP's own (PyTorch ops on all pairs at once); the down projection scales each pair by its routing weight and
writes it in the pair's place, so a token's k outputs are summed by a view. The experts' weights are stacked
[experts, out, in] once at load, each expert's Linear then viewing its slice (no second copy).

On a CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it.
"""

import logging

import torch
import triton
import triton.language as tl
from torch import nn

from model.linear_triton import dot_dtype

log = logging.getLogger(__name__)

# the kernel's largest error against the loop over experts (relative to the outputs' largest value) it may have
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.01}


@triton.jit
def _grouped_gemm(
    a_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,  # a [rows, K], w [E, N, K], bias [E, N], scale [P], out [P, N]
    order_ptr, tile_expert_ptr, first_pair_ptr, counts_ptr, first_tile_ptr, num_tiles_ptr,
    N, K, stride_a, stride_we, stride_wn, stride_out,
    PAIRS_PER_ROW: tl.constexpr,  # pairs that read one row of a: top k (rows are tokens), or 1 (rows are pairs)
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        w = tl.load(
            w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :],
            mask=in_n[:, None] & in_k[None, :],
            other=0.0,
        )
        acc += tl.dot(a.to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * N + n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + pair, mask=real, other=0.0)[:, None]
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


def grouped_gemm(
    a: torch.Tensor,  # [rows, K]: the tokens (pairs_per_row = k) or the pairs (1)
    w: torch.Tensor,  # [experts, N, K]
    bias: torch.Tensor | None,  # [experts, N]
    plan: Plan,
    pairs_per_row: int,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None = None,  # [pairs] float32: each pair's output times this
) -> torch.Tensor:  # [pairs, N]: pair p's row a[p // pairs_per_row] times its expert's weight
    N, K = w.shape[1:]
    a = a.contiguous()  # the kernel steps over a row's K elements one by one
    out = torch.empty(plan.pairs, N, dtype=out_dtype, device=a.device)
    dot = dot_dtype(a)
    block_n = 64
    grid = (plan.grid_tiles, triton.cdiv(N, block_n))
    _grouped_gemm[grid](
        a, w, bias if bias is not None else w, scale if scale is not None else out, out,
        plan.order, plan.tile_expert, plan.first_pair, plan.counts, plan.first_tile, plan.num_tiles,
        N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        PAIRS_PER_ROW=pairs_per_row, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=64, DOT=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32",
    )  # fmt: skip
    return out


class GroupedExperts:
    """A sparse layer's experts (model/moe.py's MLPs, dense weights) as the two grouped GEMMs above."""

    def __init__(self, experts: nn.ModuleList):
        self.activation = experts[0].activation  # every expert's kind is the model's
        self.num_experts = len(experts)
        self.up, self.up_bias = _stack([e.up for e in experts])
        self.down, self.down_bias = _stack([e.down for e in experts])

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] float32: sum over each token's k experts (ids [T, k]) of weight * expert(x)."""
        T, k = ids.shape
        # a tile's rows share one read of the expert's weight: 16 (the dots' smallest) unless experts average more
        block_m = 64 if T * k >= 64 * self.num_experts else 16
        plan = Plan(ids, self.num_experts, block_m)
        h = grouped_gemm(x, self.up, self.up_bias, plan, k, x.dtype)  # [T * k, up]
        y = grouped_gemm(
            self.activation(h), self.down, self.down_bias, plan, 1, torch.float32, weights.flatten().float()
        )
        return y.view(T, k, -1).sum(1)


def _stack(linears: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights as one [experts, out, in] tensor (and biases [experts, out]), each layer's parameter
    then a view of its slice: the stacked copy is the only one."""
    weight = torch.stack([linear.weight.detach() for linear in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.stack([linear.bias.detach() for linear in linears])
    for i, linear in enumerate(linears):
        linear.weight = nn.Parameter(weight[i], requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias[i], requires_grad=False)
    return weight, bias


def grouped_experts(experts: nn.ModuleList) -> GroupedExperts | None:
    """The layer's experts as grouped GEMMs, where the kernel computes on this device what the loop over experts
    does (checked once per shape and dtype, on a step of a few tokens); else None, logged with why: the loop."""
    grouped = GroupedExperts(experts)
    w = grouped.up
    key = (*w.shape, *grouped.down.shape[1:], w.dtype, w.device, grouped.up_bias is not None)
    if key not in _works:
        _works[key] = _check(grouped, experts)
    return grouped if _works[key] else None


_works: dict[tuple, bool] = {}  # (shapes, dtype, device, biases) -> whether the kernel is right here


def _check(grouped: GroupedExperts, experts: nn.ModuleList) -> bool:
    g = torch.Generator().manual_seed(0)
    E, k = grouped.num_experts, min(2, grouped.num_experts)
    hidden = grouped.up.shape[2]
    T = 5
    x = torch.randn(T, hidden, generator=g).to(grouped.up.device, grouped.up.dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(x.device)
    weights = torch.rand(T, k, generator=g).to(x.device)
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
