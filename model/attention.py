"""Paged attention: a step's new K/V are written by slot, and every query reads its keys through block tables.

Each backend owns its metadata and builds it once per step (`build`) from the step's sequences; the runner picks
the backend once, at start. The model only calls `paged_attention`, which writes K/V and attends as the
metadata says:
- CpuKernelAttention (model/attention_cpu.py): kvserve's C++ kernel, the CPU default.
- TritonAttention (model/attention_triton.py): kvserve's Triton kernel, the GPU default.
- TorchAttention (here): PyTorch ops, the fallback where either kernel cannot run (SDPA on a GPU).

TorchAttention gathers a step's flat, unpadded tokens ([T, ...]) into at most two padded groups: decode rows
(one query each) and prefill rows (a chunk of queries each). Every row's numbers depend only on its own queries
and keys, never on the padding its group needed: CPU GEMMs give bit-identical rows for any batch size and key
padding as long as a matmul has enough rows (none for bfloat16, 4 for float32, measured on x86 with torch 2.13:
min_query_len_for_invariance) and its key length is a multiple of KEY_TILE (the fused SDPA CPU kernel does not
have this property). `min_query_len` pads every row's queries so that holds.
"""

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model import invariance
from model.device import to_device

# Key lengths are padded to a multiple of this so no GEMM runs a short vector tail over the keys.
KEY_TILE = 16


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor | None,  # [T, KVH, D]; None: a layer that reads an earlier layer's K/V (q comes rotated)
    v: torch.Tensor | None,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [KVH, num_slots, D] this layer's keys
    v_cache: torch.Tensor,
    meta,  # the step's metadata, from the backend's build()
    rope: tuple[torch.Tensor, torch.Tensor] | None,  # (cos, sin), each [T, 1, D]; None: no rotary positions
    scale: float,
    window: int | None = None,  # keys further back than this are not attended (this layer's sliding window)
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [H] float32 logits that join each softmax, with no value (GPT-OSS)
) -> torch.Tensor:  # [T, H, D]
    """softmax(rope(q) rope(k)^T * scale) v over each token's sequence: q and k rotated by their positions,
    the new k and v written into the cache by slot, and every query reading its keys through the block table."""
    return meta.attend(q, k, v, k_cache, v_cache, rope, scale, window, softcap, sinks)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] in Hugging Face's half-split layout; cos [T, 1, D] = (cos, cos), sin = (-sin, sin).

    Equals (x1 cos - x2 sin, x2 cos + x1 sin) bit for bit: rolling by D/2 swaps the halves.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def flat_positions(query_lens: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
    """(positions [T], first flat token of each sequence) for sequences whose last query_lens[i] of seq_lens[i]
    tokens are new this step, laid out flat in the given order."""
    positions: list[int] = []
    starts = []
    for qlen, slen in zip(query_lens, seq_lens, strict=True):
        starts.append(len(positions))
        positions.extend(range(slen - qlen, slen))
    return positions, starts


def flat_slots(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:
    """The cache slots [T] of the step's new tokens, flat as flat_positions lays them out, through one block
    table per sequence (one KV group's)."""
    slots: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots.extend(slots_for(table, slen - qlen, slen, block_size))
    return slots


def kernel_tables(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[list[int]]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """What a kernel that reads the cache in place takes (the C++ CPU kernel's, the Triton one's), on the host:
    flat positions [T], each sequence's [first flat token, query length, sequence length] as [S, 3] int32, and per
    KV group the new tokens' slots [T] and the block tables [S, N] int32, padded with block 0. A negative entry (no
    block: a sliding-window layer's behind its window, which the kernels start after) reads as block 0 too."""
    positions, starts = flat_positions(query_lens, seq_lens)
    n_blocks = [-(-s // block_size) for s in seq_lens]
    width = max(n_blocks)
    seqs = torch.tensor([starts, query_lens, seq_lens], dtype=torch.int32).T.contiguous()
    groups = []
    for g in range(len(block_tables[0])):
        tables = [t[g] for t in block_tables]
        slots = flat_slots(query_lens, seq_lens, tables, block_size)
        # one tensor from lists (per-row copies cost more)
        rows = [table[:n] + [0] * (width - n) for n, table in zip(n_blocks, tables, strict=True)]
        groups.append((torch.tensor(slots), torch.tensor(rows, dtype=torch.int32).clamp_(min=0)))
    return torch.tensor(positions), seqs, groups


def rotate_and_store(q, k, v, k_cache, v_cache, slot_mapping, rope):
    """q and k rotated by their positions (rope = (cos, sin), or None), the new k and v written into the cache
    by slot (in the cache's dtype, which may differ from the step's: bfloat16 under float32, cpu_tier.py). k and
    v None: a layer that reads another's K/V, writing none (its q comes rotated)."""
    if k is None:
        return q, k
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
    return q, k


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions start..end-1 of a sequence (slot = block * block_size + offset)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [B, Q] flat token index of each query slot; padding repeats a real token
    # [B * KVH * N] rows of the cache viewed as [KVH * blocks, block_size * D], or where the KV groups' heads differ
    # (a strided cache: model/kv_cache.py) the [B * N] blocks; per KV group (None until set)
    gather_index: torch.Tensor | None
    masked: dict[int | None, torch.Tensor]  # its window -> [B, 1, Q, 1, L] bool, True = may NOT attend
    valid: torch.Tensor  # [n] indices into the flattened [B * Q] query slots that are real tokens
    out_index: torch.Tensor  # [n] flat token index of each real query slot, in `valid` order
    first_blocks: list[int]  # each row's first key block (a sliding window's: the first its queries reach)
    num_blocks: int  # the key blocks each row reads from its first: its sequence's, then padding
    whole: bool = False  # the query slots are exactly the step's tokens in flat order (e.g. all decodes)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor | None  # [T] cache slot where each new token's K/V are written
    groups: list[AttentionGroup]  # decode rows, then prefill rows (each may be absent)
    block_size: int
    sdpa: bool  # torch's fused SDPA (GPUs) rather than two matmuls

    def attend(
        self, q, k, v, k_cache, v_cache, rope, scale: float, window=None, softcap=None, sinks=None
    ) -> torch.Tensor:
        q, k = rotate_and_store(q, k, v, k_cache, v_cache, self.slot_mapping, rope)
        fn = attend_sdpa if self.sdpa else attend
        out = None
        for g in self.groups:  # at most two: decodes, prefill chunks
            B, Q = g.query_index.shape
            keys, values = (
                gather_keys(c, g.gather_index, self.block_size, B).to(q.dtype) for c in (k_cache, v_cache)
            )
            queries = q.view(B, Q, *q.shape[1:]) if g.whole else q[g.query_index]
            o = fn(queries, keys, values, g.masked[window], scale, softcap, sinks)  # [B, Q, H, D]
            if g.whole:
                return o.reshape(q.shape)
            if out is None:
                out = torch.empty_like(q)
            # reshape: without grouped heads (as many KV heads as query heads) o is not contiguous
            out[g.out_index] = o.reshape(B * Q, *q.shape[1:])[g.valid]
        return out


class TorchAttention:
    """Attention with PyTorch ops over K/V gathered by block table: two matmuls on CPU, fused SDPA on GPUs."""

    def __init__(
        self,
        block_size: int,
        num_kv_heads: int | None,
        num_cache_blocks: int,
        device: torch.device | str = "cpu",
        group_windows: Sequence[int | None] = (None,),
        min_query_len: int = 1,
        sdpa: bool = False,
    ):
        """num_kv_heads: the cache's, None where its KV groups' heads differ (then it is gathered by block).
        group_windows: each KV group's sliding window (None: full attention), in the order of a sequence's
        block tables; a sliding group's rows gather only the blocks their window reaches. sdpa: torch's fused
        SDPA (GPUs) rather than two matmuls (whose rows are batch-invariant on CPU)."""
        self.block_size, self.num_kv_heads, self.num_cache_blocks = block_size, num_kv_heads, num_cache_blocks
        self.device = torch.device(device)
        self.group_windows = list(group_windows)
        self.min_query_len = min_query_len
        self.sdpa = sdpa

    def build(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[TorchAttentionMetadata]]:
        """Flat positions [T] and the step's metadata, one per KV group (model/config.py's kv_groups), from each
        sequence's query length, length and block tables (one per KV group)."""
        positions, starts = flat_positions(query_lens, seq_lens)
        metas = [TorchAttentionMetadata(None, [], self.block_size, self.sdpa) for _ in self.group_windows]
        for is_decode in (True, False):
            rows = [i for i, q in enumerate(query_lens) if (q == 1) == is_decode]
            if rows:
                lens = [(starts[i], query_lens[i], seq_lens[i]) for i in rows]
                by_window: dict[int | None, AttentionGroup] = {}  # the same queries and masks for one window
                for g, (meta, window) in enumerate(zip(metas, self.group_windows, strict=True)):
                    if window not in by_window:
                        by_window[window] = self._group(lens, window)
                    group = by_window[window]
                    gather = self._gather_index([block_tables[i][g] for i in rows], group)
                    meta.groups.append(dataclasses.replace(group, gather_index=gather))
        for g, meta in enumerate(metas):
            # one group without padded query slots: its [B, Q] slots are the flat tokens themselves
            if len(meta.groups) == 1:
                meta.groups[0].whole = meta.groups[0].valid.numel() == meta.groups[0].query_index.numel()
            slots = flat_slots(query_lens, seq_lens, [t[g] for t in block_tables], self.block_size)
            meta.slot_mapping = to_device(torch.tensor(slots), self.device)
        return to_device(torch.tensor(positions), self.device), metas

    def _group(self, rows, window: int | None) -> AttentionGroup:
        """The query slots and mask of rows (first flat token, query length, sequence length) in layers of this
        window; its gather_index comes per KV group (_gather_index). Each row's keys start at the first block its
        first query reads (block 0 without a window) and run to its last, padded to the longest row's count."""
        block_size, device = self.block_size, self.device
        q_max = max(self.min_query_len, max(q for _, q, _ in rows))
        first = [0 if window is None else max(0, s - q - window + 1) // block_size for _, q, s in rows]
        n_blocks = max(math.ceil(s / block_size) - f for (_, _, s), f in zip(rows, first, strict=True))
        while (n_blocks * block_size) % KEY_TILE:
            n_blocks += 1
        L = n_blocks * block_size

        start, qlen, slen = (torch.tensor([row[j] for row in rows]) for j in range(3))
        q_off = torch.arange(q_max)
        real = q_off < qlen[:, None]  # [B, Q]
        # padded query slots repeat the row's first token: harmless to compute, dropped by `valid`
        query_index = start[:, None] + torch.where(real, q_off, 0)
        q_pos = (slen - qlen)[:, None] + torch.where(real, q_off, 0)  # [B, Q] position of each query
        k_pos = (torch.tensor(first) * block_size)[:, None, None] + torch.arange(L)  # [B, 1, L]
        allowed = (k_pos <= q_pos[..., None]) & (k_pos < slen[:, None, None])  # [B, Q, L]
        if window is not None:
            allowed &= k_pos > q_pos[..., None] - window
        valid = real.flatten().nonzero().squeeze(1)
        return AttentionGroup(
            query_index=to_device(query_index, device),
            gather_index=None,
            masked={window: to_device((~allowed)[:, None, :, None, :], device)},
            valid=to_device(valid, device),
            out_index=to_device(query_index.flatten()[valid], device),
            first_blocks=first,
            num_blocks=n_blocks,
        )

    def _gather_index(self, tables: list[list[int]], group: AttentionGroup) -> torch.Tensor:
        """The cache rows of each row's group.num_blocks blocks from its first, through its table. Padding, and a
        negative entry (no block: a sliding-window layer's behind its window), read block 0, which the mask
        hides."""
        key_blocks = torch.zeros(len(tables), group.num_blocks, dtype=torch.long)
        for r, (table, first) in enumerate(zip(tables, group.first_blocks, strict=True)):
            t = table[first : first + group.num_blocks]
            key_blocks[r, : len(t)] = torch.tensor(t, dtype=torch.long)
        key_blocks.clamp_(min=0)
        if self.num_kv_heads is None:
            return to_device(key_blocks.flatten(), self.device)
        rows = cache_rows(key_blocks, self.num_kv_heads, self.num_cache_blocks)
        return to_device(rows, self.device)


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
                    rows,
                    invariance.rows_for_invariance(
                        lambda x, y=y: (x.expand(2, -1, -1) @ y).transpose(0, 1), x
                    ),
                )
    return math.ceil(rows / (num_heads // num_kv_heads))


def cache_rows(key_blocks: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """[B * KVH * N] indices of the blocks [B, N] for every KV head, in a cache viewed as
    [KVH * num_blocks, block_size * D]: sequence-major, so the gathered keys are [B, KVH, keys, D]."""
    heads = torch.arange(num_kv_heads, device=key_blocks.device)[:, None] * num_blocks  # [KVH, 1]
    return (key_blocks[:, None, :] + heads).flatten()


def gather_keys(cache: torch.Tensor, index: torch.Tensor, block_size: int, batch: int) -> torch.Tensor:
    """[batch, KVH, keys, D]: the blocks `index` names (TorchAttention's gather_index) of a [KVH, slots, D] cache:
    rows of a contiguous cache (gather_blocks), or blocks of a strided one (whose groups' heads differ)."""
    KVH, _, D = cache.shape
    if cache.is_contiguous():
        return gather_blocks(cache, index, block_size).view(batch, KVH, -1, D)
    blocks = cache.unflatten(1, (-1, block_size)).index_select(1, index)  # [KVH, batch * N, block_size, D]
    return blocks.view(KVH, batch, -1, D).transpose(0, 1)


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [H]: a logit per head that joins the softmax and takes no value
) -> torch.Tensor:  # [B, Q, H, D]
    B, Q, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    # grouped-query attention without repeating K/V: the G heads sharing a KV head become extra query rows.
    # For decodes (Q = 1) the transposes below are views, not copies.
    qg = (q * scale).view(B, Q, KVH, G, D).transpose(1, 2).reshape(B, KVH, Q * G, D)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, KVH, Q*G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(B, KVH, Q, G, -1).masked_fill_(masked, float("-inf"))
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least float32
    if sinks is not None:  # the sink as one more key column, dropped after the softmax
        sink = sinks.to(acc).view(1, KVH, 1, G, 1).expand(B, KVH, Q, G, 1)
        probs = torch.softmax(torch.cat((scores.to(acc), sink), -1), dim=-1)[..., :-1]
        probs = probs.to(v.dtype).reshape(B, KVH, Q * G, -1)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=acc).to(v.dtype).view(B, KVH, Q * G, -1)
    out = torch.matmul(probs, v)  # [B, KVH, Q*G, D]
    return out.view(B, KVH, Q, G, D).transpose(1, 2).reshape(B, Q, H, D)


def attend_sdpa(q, k, v, masked, scale, softcap=None, sinks=None) -> torch.Tensor:
    """attend() through torch's fused SDPA kernels: faster on GPUs, but its rows depend on key padding."""
    if softcap is not None or sinks is not None:  # SDPA has neither soft-cap nor sinks
        return attend(q, k, v, masked, scale, softcap, sinks)
    mask = ~masked[:, :, :, 0, :]  # [B, 1, Q, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [B, H, Q, D]
    return out.transpose(1, 2)


def naive_attention(q, k, v, scale, causal_offset=0, sinks=None):
    """The textbook formula softmax(QK^T * scale + M) V for one sequence, for tests: q [Q, H, D], k/v [L, KVH, D];
    sinks [H]: a logit per head as one more key in the softmax, whose weight is dropped."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    Q, L = q.shape[0], k.shape[0]
    allowed = torch.arange(L)[None, :] <= torch.arange(Q)[:, None] + causal_offset
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double()[:, None, None].expand(H, Q, 1)), -1)
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1)[..., :-1], v.double())
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.double())
