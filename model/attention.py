"""Paged attention: K/V written by slot, read back by block table, batch-invariant.

On the CPU a C++ kernel (model/csrc/paged_attention.cpp, built by model/kernels.py) reads keys and values
straight from the cache through the block tables. The PyTorch path below is the fallback where it cannot be
built, and the path on GPUs (SDPA).

There, one step's tokens arrive flat and unpadded ([T, ...]) and are gathered into at most two padded groups:
decode rows (one query each) and prefill rows (a chunk of queries each). Every row's numbers depend only on
its own queries and keys, never on the padding its group needed: CPU GEMMs give bit-identical rows for any
batch size and key padding as long as a matmul has enough rows (none for bfloat16, 4 for float32, measured
on x86 with torch 2.13: min_query_len_for_invariance) and its key length is a multiple of KEY_TILE (the fused
SDPA CPU kernel does not have this property). `min_query_len` pads every row's queries so that holds.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.kernels import cpu_kernels

# CPU GEMMs may take other kernels (other summation orders) for fewer rows than some small count, which
# depends on the library, the dtype and the weight layout (measured: rows_for_invariance). At most this.
MIN_INVARIANT_ROWS = 12
# Key lengths are padded to a multiple of this so no GEMM runs a short vector tail over the keys.
KEY_TILE = 16
# The C++ kernel's unit of work: one KV head of this many queries of one sequence.
KERNEL_CHUNK = 16


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [B, Q] flat token index of each query slot; padding repeats a real token
    key_blocks: torch.Tensor  # [B, N] cache block of each run of block_size keys; padding -> block 0
    masked: torch.Tensor  # [B, 1, Q, 1, L] bool, True = may NOT attend (future, beyond context, window)
    valid: torch.Tensor  # [n] indices into the flattened [B * Q] query slots that are real tokens
    out_index: torch.Tensor  # [n] flat token index of each real query slot, in `valid` order
    whole: bool = False  # the query slots are exactly the step's tokens in flat order (e.g. all decodes)
    gather_index: torch.Tensor | None = None  # [B * KVH * N] rows of the cache to gather; set at first use


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K/V are written
    groups: list[AttentionGroup]  # decode rows, then prefill rows (each may be absent); PyTorch path only
    block_size: int
    # the C++ kernel's inputs (model/csrc/paged_attention.cpp) when it is used, else None
    block_tables: torch.Tensor | None = None  # [S, N] int32, padding -> block 0
    seqs: torch.Tensor | None = None  # [S, 3] int32: first flat token, query length, sequence length
    window: int = 0  # sliding window (keys per query), 0 = none


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
    min_query_len: int = 1,
    cpu_kernel: bool = False,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Flat positions [T] and the metadata for sequences whose last query_lens[i] of seq_lens[i] tokens are new.

    The sequences' tokens must be laid out flat in the given order. cpu_kernel: build the C++ kernel's block
    tables instead of the PyTorch path's padded groups.
    """
    positions: list[int] = []
    slots: list[int] = []
    starts = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        starts.append(len(positions))
        positions.extend(range(slen - qlen, slen))
        slots.extend(slots_for(table, slen - qlen, slen, block_size))
    if cpu_kernel:  # the kernel runs on the CPU: no device copies
        n_blocks = [math.ceil(s / block_size) for s in seq_lens]
        tables = torch.zeros(len(seq_lens), max(n_blocks), dtype=torch.int32)
        for r, (n, table) in enumerate(zip(n_blocks, block_tables, strict=True)):
            tables[r, :n] = torch.tensor(table[:n])
        seqs = torch.tensor([starts, query_lens, seq_lens], dtype=torch.int32).T.contiguous()
        meta = AttentionMetadata(torch.tensor(slots), [], block_size, tables, seqs, sliding_window or 0)
        return torch.tensor(positions), meta
    groups = []
    for is_decode in (True, False):
        rows = [i for i, q in enumerate(query_lens) if (q == 1) == is_decode]
        if rows:
            lens = [(starts[i], query_lens[i], seq_lens[i], block_tables[i]) for i in rows]
            groups.append(_build_group(lens, block_size, sliding_window, min_query_len, device))
    # one group without padded query slots: its [B, Q] slots are the flat tokens themselves
    if len(groups) == 1:
        groups[0].whole = groups[0].valid.numel() == groups[0].query_index.numel()
    meta = AttentionMetadata(torch.tensor(slots).to(device, non_blocking=True), groups, block_size)
    return torch.tensor(positions).to(device, non_blocking=True), meta


def _build_group(rows, block_size, window, min_query_len, device) -> AttentionGroup:
    q_max = max(min_query_len, max(q for _, q, _, _ in rows))
    n_blocks = max(math.ceil(s / block_size) for _, _, s, _ in rows)
    while (n_blocks * block_size) % KEY_TILE:
        n_blocks += 1
    L = n_blocks * block_size
    key_blocks = torch.zeros(len(rows), n_blocks, dtype=torch.long)
    for r, (_, _, s, table) in enumerate(rows):
        t = table[: math.ceil(s / block_size)]
        key_blocks[r, : len(t)] = torch.tensor(t, dtype=torch.long)

    start, qlen, slen = (torch.tensor([row[j] for row in rows]) for j in range(3))
    q_off = torch.arange(q_max)
    real = q_off < qlen[:, None]  # [B, Q]
    # padded query slots repeat the row's first token: harmless to compute, dropped by `valid`
    query_index = start[:, None] + torch.where(real, q_off, 0)
    q_pos = (slen - qlen)[:, None] + torch.where(real, q_off, 0)  # [B, Q] position of each query
    k_pos = torch.arange(L)
    allowed = (k_pos <= q_pos[..., None]) & (k_pos < slen[:, None, None])  # [B, Q, L]
    if window is not None:
        allowed &= k_pos > q_pos[..., None] - window
    valid = real.flatten().nonzero().squeeze(1)
    return AttentionGroup(
        query_index=query_index.to(device, non_blocking=True),
        key_blocks=key_blocks.to(device, non_blocking=True),
        masked=(~allowed)[:, None, :, None, :].to(device, non_blocking=True),
        valid=valid.to(device, non_blocking=True),
        out_index=query_index.flatten()[valid].to(device, non_blocking=True),
    )


def rows_for_invariance(fn, x: torch.Tensor, max_rows: int = MIN_INVARIANT_ROWS) -> int:
    """The fewest rows a batch must be padded to so that fn (a GEMM over the rows of x) gives every row the
    bits it gets inside the whole batch, alone or in any smaller batch.

    CPU GEMM libraries pick other kernels (other summation orders) for small row counts, and which shapes are
    affected depends on the library, the CPU, the dtype and the weight's layout, so it is measured rather
    than assumed. A kernel that differs does so on a few percent of rows, hence every row checked alone.
    """
    ref = fn(x)
    for m in (1, 2, 4, 8):
        if m >= max_rows:
            break
        alone = all(
            torch.equal(fn(F.pad(x[i : i + 1], (0, 0, 0, m - 1)))[:1], ref[i : i + 1]) for i in range(len(x))
        )
        if alone and all(torch.equal(fn(x[:n]), ref[:n]) for n in range(m, max_rows + 1)):
            return m
    return max_rows


def min_query_len_for_invariance(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> int:
    """Query slots every attention row must be padded to so that its matmuls (scores = q k^T, out = p v, with
    num_heads / num_kv_heads query rows per query slot) give it the same bits in any batch."""
    g = torch.Generator().manual_seed(0)
    rows = 1
    for L in (KEY_TILE, 11 * KEY_TILE):
        # batched like the real thing ([KVH, B, rows, D] matmuls run as bmm, another path than 2-D mm)
        k = torch.randn(2, head_dim, L, generator=g).to(device, dtype)
        v = torch.randn(2, L, head_dim, generator=g).to(device, dtype)
        q = torch.randn(64, head_dim, generator=g).to(device, dtype)
        p = torch.rand(64, L, generator=g).to(device, dtype)
        with torch.inference_mode():
            for x, y in ((q, k), (p, v)):
                rows = max(
                    rows, rows_for_invariance(lambda x, y=y: (x.expand(2, -1, -1) @ y).transpose(0, 1), x)
                )
    return math.ceil(rows / (num_heads // num_kv_heads))


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (RoPE applied)
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [KVH, num_slots, D] this layer's keys
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    if meta.seqs is not None:
        tables, seqs, window = meta.block_tables, meta.seqs, meta.window
        kernel = cpu_kernels().paged_attention
        return kernel(q, k_cache, v_cache, tables, seqs, meta.block_size, scale, window, KERNEL_CHUNK)
    KVH, _, D = k_cache.shape
    caches = (k_cache, v_cache)
    fn = attend if q.device.type == "cpu" else attend_sdpa
    out = None
    for g in meta.groups:  # at most two: decodes, prefill chunks
        B, Q = g.query_index.shape
        if g.gather_index is None:  # the same for every layer of the step
            g.gather_index = cache_rows(g.key_blocks, KVH, k_cache.shape[1] // meta.block_size)
        keys, values = (gather_blocks(c, g.gather_index, meta.block_size).view(B, KVH, -1, D) for c in caches)
        queries = q.view(B, Q, *q.shape[1:]) if g.whole else q[g.query_index]
        o = fn(queries, keys, values, g.masked, scale)  # [B, Q, H, D]
        if g.whole:
            return o.reshape(q.shape)
        if out is None:
            out = torch.empty_like(q)
        out[g.out_index] = o.view(B * Q, *q.shape[1:])[g.valid]
    return out


def cache_rows(key_blocks: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """[B * KVH * N] indices of the blocks [B, N] for every KV head, in a cache viewed as
    [KVH * num_blocks, block_size * D]: sequence-major, so the gathered keys are [B, KVH, keys, D]."""
    heads = torch.arange(num_kv_heads, device=key_blocks.device)[:, None] * num_blocks  # [KVH, 1]
    return (key_blocks[:, None, :] + heads).flatten()


def gather_blocks(cache: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[len(rows), block_size * D]: a copy of the given blocks (rows from cache_rows) of a [KVH, slots, D] cache.

    One gather of contiguous block_size * D rows per layer and cache: per head it was three times the calls,
    which cost more than the copy itself for a single sequence."""
    D = cache.shape[-1]
    return cache.view(-1, block_size * D).index_select(0, rows)


def attend(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, KVH, L, D]
    v: torch.Tensor,  # [B, KVH, L, D]
    masked: torch.Tensor,  # [B, 1, Q, 1, L] bool, True = may not attend
    scale: float,
) -> torch.Tensor:  # [B, Q, H, D]
    B, Q, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    # grouped-query attention without repeating K/V: the G heads sharing a KV head become extra query rows.
    # For decodes (Q = 1) the transposes below are views, not copies.
    qg = (q * scale).view(B, Q, KVH, G, D).transpose(1, 2).reshape(B, KVH, Q * G, D)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, KVH, Q*G, L]
    scores = scores.view(B, KVH, Q, G, -1).masked_fill_(masked, float("-inf"))
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least float32
    probs = torch.softmax(scores, dim=-1, dtype=acc).to(v.dtype).view(B, KVH, Q * G, -1)
    out = torch.matmul(probs, v)  # [B, KVH, Q*G, D]
    return out.view(B, KVH, Q, G, D).transpose(1, 2).reshape(B, Q, H, D)


def attend_sdpa(q, k, v, masked, scale) -> torch.Tensor:
    """attend() through torch's fused SDPA kernels: faster on GPUs, but its rows depend on key padding."""
    mask = ~masked[:, :, :, 0, :]  # [B, 1, Q, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, Q, D]
    return out.transpose(1, 2)


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
