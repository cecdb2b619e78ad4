"""Paged attention in pure PyTorch: K/V written by slot, read back by block table, batch-invariant.

One step's tokens arrive flat and unpadded ([T, ...]). For attention they are gathered into at most two
padded groups: decode rows (one query each) and prefill rows (a chunk of queries each). Every row's numbers
depend only on its own queries and keys, never on the padding its group needed: the matmuls below give
bit-identical rows for any batch size and key padding (measured for bfloat16; for float32 when a matmul has
at least MIN_INVARIANT_ROWS rows, which `min_rows` pads up to). SDPA's fused CPU kernel does not.
"""

import math
from dataclasses import dataclass

import torch

# float32 GEMMs on x86 CPUs take other kernel paths (other summation orders) below this many rows.
MIN_INVARIANT_ROWS = 12
# Key lengths are padded to a multiple of this so no GEMM ever runs a short vector tail over the keys.
KEY_TILE = 16


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [B, Q] flat token index of each query slot; padding points at a real token
    key_slots: torch.Tensor  # [B, L] cache slot of each key position; padding -> slot 0
    mask: torch.Tensor  # [B, 1, Q, 1, L] bool, True = attend (causal, context length, sliding window)
    valid: torch.Tensor  # [n] indices into the flattened [B * Q] query slots that are real tokens
    out_index: torch.Tensor  # [n] flat token index of each real query slot, in `valid` order


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K/V are written
    groups: list[AttentionGroup]  # decode rows, then prefill rows (each may be absent)
    min_rows: int = 0  # pad every attention matmul to this many query rows (float32 batch invariance)


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1 of a sequence (slot = block * block_size + offset)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    sliding_window: int | None = None,
    min_rows: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Flat positions [T] and the metadata for sequences whose last query_lens[i] of seq_lens[i] tokens are new.

    The sequences' tokens must be laid out flat in the given order.
    """
    positions: list[int] = []
    slots: list[int] = []
    starts = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        starts.append(len(positions))
        positions.extend(range(slen - qlen, slen))
        slots.extend(slots_for(table, slen - qlen, slen, block_size))
    groups = []
    for is_decode in (True, False):
        rows = [i for i, q in enumerate(query_lens) if (q == 1) == is_decode]
        if rows:
            groups.append(
                _build_group(
                    rows, starts, query_lens, seq_lens, block_tables, block_size, sliding_window, device
                )
            )
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
        groups=groups,
        min_rows=min_rows,
    )
    return torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True), meta


def _build_group(
    rows, starts, query_lens, seq_lens, block_tables, block_size, window, device
) -> AttentionGroup:
    q_max = max(query_lens[i] for i in rows)
    n_blocks = max(math.ceil(seq_lens[i] / block_size) for i in rows)
    tables = torch.zeros(len(rows), n_blocks, dtype=torch.long)
    for r, i in enumerate(rows):
        t = block_tables[i][: math.ceil(seq_lens[i] / block_size)]
        tables[r, : len(t)] = torch.tensor(t, dtype=torch.long)
    key_slots = (tables.unsqueeze(-1) * block_size + torch.arange(block_size)).view(len(rows), -1)
    L = math.ceil(key_slots.shape[1] / KEY_TILE) * KEY_TILE
    key_slots = torch.nn.functional.pad(key_slots, (0, L - key_slots.shape[1]))

    qlen = torch.tensor([query_lens[i] for i in rows])
    slen = torch.tensor([seq_lens[i] for i in rows])
    start = torch.tensor([starts[i] for i in rows])
    q_off = torch.arange(q_max)
    real = q_off < qlen[:, None]  # [B, Q]
    # padded query slots point at the row's first token: harmless to compute, dropped by `valid`
    query_index = start[:, None] + torch.where(real, q_off, 0)
    q_pos = (slen - qlen)[:, None] + q_off  # [B, Q] position of each query
    k_pos = torch.arange(L)
    mask = (k_pos <= q_pos[..., None]) & (k_pos < slen[:, None, None])  # [B, Q, L]
    if window is not None:
        mask &= k_pos > q_pos[..., None] - window
    mask |= ~real[..., None] & (k_pos == 0)  # padded queries attend to one key, so no row is all -inf
    valid = real.flatten().nonzero().squeeze(1)
    return AttentionGroup(
        query_index=query_index.to(device, non_blocking=True),
        key_slots=key_slots.to(device, non_blocking=True),
        mask=mask[:, None, :, None, :].to(device, non_blocking=True),
        valid=valid.to(device, non_blocking=True),
        out_index=query_index.flatten()[valid].to(device, non_blocking=True),
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (RoPE applied)
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D] this layer's keys
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for g in meta.groups:  # at most two: decodes, prefill chunks
        B, Q = g.query_index.shape
        o = attend(q[g.query_index], k_cache[g.key_slots], v_cache[g.key_slots], g.mask, scale, meta.min_rows)
        out[g.out_index] = o.reshape(B * Q, *q.shape[1:])[g.valid]
    return out


def attend(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, L, KVH, D]
    v: torch.Tensor,  # [B, L, KVH, D]
    mask: torch.Tensor,  # [B, 1, Q, 1, L] bool
    scale: float,
    min_rows: int = 0,
) -> torch.Tensor:  # [B, Q, H, D]
    B, Q, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    # grouped-query attention without repeating K/V: the G heads sharing a KV head become extra query rows
    qg = q.view(B, Q, KVH, G, D).permute(0, 2, 1, 3, 4).reshape(B, KVH, Q * G, D)
    rows = Q * G
    if rows < min_rows:
        qg = torch.cat([qg, qg.new_zeros(B, KVH, min_rows - rows, D)], dim=2)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1))[:, :, :rows]  # [B, KVH, Q*G, L]
    acc = torch.promote_types(scores.dtype, torch.float32)  # softmax in at least float32
    scores = scores.to(acc).view(B, KVH, Q, G, -1).mul_(scale).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B, KVH, rows, -1)
    if rows < min_rows:
        probs = torch.cat([probs, probs.new_zeros(B, KVH, min_rows - rows, probs.shape[-1])], dim=2)
    out = torch.matmul(probs, v.transpose(1, 2))[:, :, :rows]  # [B, KVH, Q*G, D]
    return out.view(B, KVH, Q, G, D).permute(0, 2, 1, 3, 4).reshape(B, Q, H, D)


def naive_attention(q, k, v, scale, causal_offset=0):
    """The textbook formula softmax(QK^T * scale + M) V for one sequence, for tests: q [Q, H, D], k/v [L, KVH, D]."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    Q, L = q.shape[0], k.shape[0]
    allowed = torch.arange(L)[None, :] <= torch.arange(Q)[:, None] + causal_offset
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.double())
