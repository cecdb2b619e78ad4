"""A GPU's small fused kernels: RMSNorm with its residual add, SiLU-and-multiply, and RoPE with the K/V writes.

In a decode step every elementwise op is a kernel of its own, a few microseconds each even replayed from a CUDA
graph, and a layer of PyTorch ops has ~20 of them: RoPE alone is eight (a multiply, a roll, a multiply and an add,
for queries and keys), the cache writes two more, the residual add and the SiLU's gate one each. The first H200 run
(scripts/gpu_check.py at 2a117fc) had a batch-1 step of the default model's shape (30 layers) and of a 1B's (16
layers, 9x the weights) take the same ~2.1 ms; with these kernels the default's took 1.66 ms (its graph alone
0.82 ms). Each kernel here is one launch where PyTorch's ops were several, with the same arithmetic in float32
rounded once to the output's dtype (F.rms_norm's rounding; PyTorch's SiLU and RoPE round each op in a 16-bit
dtype, so on bfloat16 their bits may differ in the last place).

Rows are independent, one program each (or a tile of one), so a token's results do not depend on its batch. On a
CPU they run under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them.
"""

import torch
import triton
import triton.language as tl

from model.attention import rotate_and_store as rotate_and_store_torch

# cache dtypes the fused K/V write stores to (an 8-bit cache is written by PyTorch's conversion)
STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, n, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the stream's sum rounded to its dtype, as x + residual is, then normed
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x = x.to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rms_norm(x + residual) * weight, x + residual] of x [N, C] (residual None: x itself; weight None: none),
    Ops.rms_norm's contract."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows, n = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    total = torch.empty_like(out) if residual is not None else x
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm[(rows,)](
            x, residual if residual is not None else x, weight if weight is not None else x, out, total,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), total.stride(0), n, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, num_warps=_warps(block),
        )  # fmt: skip
    return out, total


@triton.jit
def _silu_mul(h_ptr, out_ptr, stride_h, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024  # outputs a program: an FFN's 8,192 intermediate are 8 programs a row


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h [T, 2n] = [gate, up]: [T, n], Ops.silu_mul's contract."""
    if h.stride(-1) != 1:
        h = h.contiguous()
    rows, n = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, n, dtype=h.dtype, device=h.device)
    if rows:
        _silu_mul[(rows, triton.cdiv(n, SILU_BLOCK))](h, out, h.stride(0), out.stride(0), n, BLOCK=SILU_BLOCK)
    return out


@triton.jit
def _rope_store(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rope, stride_ot, stride_oh,
    stride_ch, stride_cs, H,
    HEAD_DIM: tl.constexpr, DP: tl.constexpr, HAS_ROPE: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.arange(0, DP)
    mask = d < HEAD_DIM
    # Hugging Face's half-split layout: element d turns with d + D/2 (rolling by D/2 swaps the halves)
    partner = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
    if HAS_ROPE:
        cos = tl.load(cos_ptr + t * stride_rope + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * stride_rope + d, mask=mask, other=0.0).to(tl.float32)
    if h < H:  # a query head: rotated into the contiguous queries the attention kernel reads
        row = q_ptr + t * stride_qt + h * stride_qh
        x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROPE:
            x = x * cos + tl.load(row + partner, mask=mask, other=0.0).to(tl.float32) * sin
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, x.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # a KV head: its key rotated and its value, written to the token's cache slot
        kv = (h - H).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        row = k_ptr + t * stride_kt + kv * stride_kh
        x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_ROPE:
            x = x * cos + tl.load(row + partner, mask=mask, other=0.0).to(tl.float32) * sin
        cached = kv * stride_ch + slot * stride_cs + d
        tl.store(k_cache_ptr + cached, x.to(k_cache_ptr.dtype.element_ty), mask=mask)
        value = tl.load(v_ptr + t * stride_vt + kv * stride_vh + d, mask=mask, other=0.0)
        tl.store(v_cache_ptr + cached, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotate_and_store(q, k, v, k_cache, v_cache, slot_mapping, rope) -> torch.Tensor:
    """model/attention.py's rotate_and_store in one kernel: q [T, H, D] and k [T, KVH, D] rotated by their
    positions (rope = (cos, sin) [T, 1, D] each, or None), k and v written into the caches [KVH, slots, D] at
    slot_mapping [T]. Returns the rotated queries, contiguous. A layer that writes no K/V (k None) or an 8-bit
    cache goes to PyTorch's ops."""
    if k is None or k_cache.dtype not in STORED_DTYPES or k_cache.stride(-1) != 1:
        return rotate_and_store_torch(q, k, v, k_cache, v_cache, slot_mapping, rope)[0].contiguous()
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if T:
        cos, sin = rope if rope is not None else (q, q)  # unread without a rope
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        _rope_store[(T, H + k.shape[1])](
            q, k, v, cos, sin, out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0) if rope is not None else 0, out.stride(0), out.stride(1), k_cache.stride(0),
            k_cache.stride(1), H,
            HEAD_DIM=D, DP=triton.next_power_of_2(D), HAS_ROPE=rope is not None,
        )  # fmt: skip
    return out
