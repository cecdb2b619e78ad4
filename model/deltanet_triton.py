"""A GPU's step of Gated DeltaNet decodes: the recurrence of model/deltanet.py's _decodes as one Triton kernel.

In PyTorch ops a DeltaNet layer's step of decodes is ~35 kernels between its gates and its norm, and it copies each
sequence's whole state out of the cache and back (~1.2 MB a layer at 16 heads of 128 x 128): the first H200 run
had a 1.5B Qwen3.5's decode step take 6.0 ms, three times a dense 1B's. Here one program takes one value head of
one sequence and a tile of its value dims, reads its state in place (S0's tile, the chunk's keys, its corrections'
tile, their log decays), and writes back what a token changes: the chunk's row for this token, and S0 where the
chunk ends (or a fresh sequence starts). The arithmetic is _decodes's, summed in other orders.

Programs of one head share the keys and log decays; the first writes this token's, which every program takes from
its registers, not from memory. On a CPU it runs under Triton's interpreter (TRITON_INTERPRET=1) in the tests.
"""

import torch
import triton
import triton.language as tl

from model.deltanet import CHUNK

VALUE_TILE = 32  # value dims a program: S0's tile of 128 key rows is 16 KB of registers


@triton.jit
def _decode(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, state_ptr, slots_ptr, positions_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_slot, stride_head, H,
    DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, BV: tl.constexpr, CHUNK: tl.constexpr,
    CP: tl.constexpr,
):  # fmt: skip
    b, h, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    position = tl.load(positions_ptr + b)
    m = position % CHUNK  # this token's row in its chunk
    fresh = position == 0
    # the head's state: S0 [DK, DV], the chunk's keys as columns [DK, CHUNK], corrections [CHUNK, DV], log decays
    base = state_ptr + slot * stride_slot + h * stride_head
    keys_at = base + DK * DV
    corrections_at = keys_at + DK * CHUNK
    log_decays_at = corrections_at + CHUNK * DV
    d = tl.arange(0, DKP)
    in_d = d < DK
    j = tl.arange(0, CP)  # the chunk's rows, padded to a dot's smallest size
    in_j = j < CHUNK
    c = tile * BV + tl.arange(0, BV)
    in_c = c < DV
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=in_d, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + d, mask=in_d, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + c, mask=in_c, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + b * H + h)
    step = tl.load(g_ptr + b * H + h)
    log_decays = tl.load(log_decays_at + j, mask=in_j, other=0.0)
    G = step + tl.where(
        m > 0, tl.sum(tl.where(j == m - 1, log_decays, 0.0), 0), 0.0
    )  # log decay since its start
    decay = tl.exp(G)
    log_decays = tl.where(j == m, G, log_decays)
    reached = j <= m  # rows past it hold an older chunk's values
    weights = tl.where(reached, tl.exp(tl.where(reached, G - log_decays, 0.0)), 0.0)  # exp(G_p - G_j)
    keys = tl.load(keys_at + d[:, None] * CHUNK + j[None, :], mask=in_d[:, None] & in_j[None, :], other=0.0)
    keys = tl.where(j[None, :] == m, k[:, None], keys)  # [DKP, CP]
    U = tl.load(corrections_at + j[:, None] * DV + c[None, :], mask=in_j[:, None] & in_c[None, :], other=0.0)
    S0 = tl.load(base + d[:, None] * DV + c[None, :], mask=in_d[:, None] & in_c[None, :], other=0.0)
    S0 = tl.where(fresh, 0.0, S0)  # [DKP, BV]
    # S^T x = exp(G) S0^T x + sum_j exp(G - G_j) (k_j . x) u_j over the chunk's rows: before this one for the
    # recall of its key, up to it for the output
    key_dots = tl.where(j < m, tl.sum(keys * k[:, None], 0) * weights, 0.0)  # [CP]
    recall = decay * tl.sum(S0 * k[:, None], 0) + tl.sum(key_dots[:, None] * U, 0)  # [BV]
    correction = (v - recall) * beta
    U = tl.where(j[:, None] == m, correction[None, :], U)
    query_dots = tl.where(reached, tl.sum(keys * q[:, None], 0) * weights, 0.0)
    out = decay * tl.sum(S0 * q[:, None], 0) + tl.sum(query_dots[:, None] * U, 0)
    tl.store(out_ptr + (b * H + h) * DV + c, out, mask=in_c)
    tl.store(corrections_at + m * DV + c, correction, mask=in_c)
    if tile == 0:
        tl.store(keys_at + d * CHUNK + m, k, mask=in_d)
        tl.store(log_decays_at + m, G)
    # a chunk's last token folds its rows into S0: S0 <- exp(G) S0 + sum_j exp(G - G_j) k_j u_j^T
    if m == CHUNK - 1:
        S0 = decay * S0 + tl.dot(keys * weights[None, :], U, input_precision="ieee")
    if (m == CHUNK - 1) | fresh:
        tl.store(base + d[:, None] * DV + c[None, :], S0, mask=in_d[:, None] & in_c[None, :])


def deltanet_decodes(q, k, v, beta, log_decay, recurrent_state, slots, positions) -> torch.Tensor:
    """A step of B decodes' delta rule, the states updated in place: q, k [B, Hv, dk] (q scaled), v [B, Hv, dv],
    beta and log_decay [B, Hv] float32, recurrent_state [slots, Hv, state_width] float32 (this layer's), slots
    and positions [B] int64 on the device. -> [B, Hv, dv] float32, S^T q."""
    B, H, dk = q.shape
    dv = v.shape[-1]
    assert recurrent_state.stride(-1) == 1 and recurrent_state.dtype == torch.float32
    out = torch.empty(B, H, dv, dtype=torch.float32, device=q.device)
    if B:
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        block = max(16, min(VALUE_TILE, triton.next_power_of_2(dv)))
        _decode[(B, H, triton.cdiv(dv, block))](
            q, k, v, beta.contiguous(), log_decay.contiguous(), recurrent_state, slots, positions, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            recurrent_state.stride(0), recurrent_state.stride(1), H,
            DK=dk, DV=dv, DKP=max(16, triton.next_power_of_2(dk)), BV=block, CHUNK=CHUNK,
            CP=max(16, triton.next_power_of_2(CHUNK)),
        )  # fmt: skip
    return out
