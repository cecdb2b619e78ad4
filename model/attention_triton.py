"""Paged attention on a GPU: one Triton kernel that reads K/V straight from the cache through the block tables.

The PyTorch path (model/attention.py) copies every row's keys and values out of the cache into padded tensors
before SDPA, in every layer of every step: a decode step's whole context, once a layer. Here each program takes one
KV head of a tile of one sequence's queries (all the query heads that share that KV head), walks the sequence's
keys a tile at a time through its block table, and keeps a running softmax (FlashAttention's online form): K/V
are read once per tile of queries, in place, and nothing is padded but the tile's own rows.

Causal masks, sliding windows, Gemma 2's soft-cap and GPT-OSS's sinks are the kernel's; RoPE and the K/V writes
are one kernel before it (model/fused_triton.py). Scores and the softmax are float32 whatever the cache holds. On
a CPU the same kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it
without a GPU.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model.attention import TorchAttention, kernel_tables, paged_attention
from model.config import ModelConfig
from model.device import to_device
from model.fused_triton import rotate_and_store
from model.kv_cache import KVCache
from model.linear_triton import dot_dtype

# keys a program reads per iteration (any number of cache blocks: a key's block comes from its position)
KEY_TILE = 32
# query rows (queries x the query heads of one KV head) a program holds at least: tl.dot's smallest tile
MIN_ROWS = 16


@triton.jit
def _paged_attention(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr,  # q/out [T, H, D], caches [KVH, slots, D], sinks [H]
    tables_ptr, seqs_ptr, tiles_ptr,  # tables [S, N] int32, seqs [S, 3] int32, tiles [P, 2] int32
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_ks, stride_table,
    scale, softcap, window,
    G: tl.constexpr,  # query heads per KV head
    GP: tl.constexpr,  # G rounded up to a power of two
    BLOCK_M: tl.constexpr,  # queries per program
    HEAD_DIM: tl.constexpr,
    DP: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    KEYS: tl.constexpr,  # keys per iteration
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT: tl.constexpr,  # the dots' input dtype
    PRECISION: tl.constexpr,  # tl.dot's: "ieee" for float32 (no TF32), the default for 16-bit
):  # fmt: skip
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq, q0 = tl.load(tiles_ptr + 2 * tile), tl.load(tiles_ptr + 2 * tile + 1)
    first_token, query_len, seq_len = (
        tl.load(seqs_ptr + 3 * seq),
        tl.load(seqs_ptr + 3 * seq + 1),
        tl.load(seqs_ptr + 3 * seq + 2),
    )
    # row r: query q0 + r // GP of the tile, query head kv_head * G + r % GP
    rows = tl.arange(0, BLOCK_M * GP)
    m, g = rows // GP, rows % GP
    real = (q0 + m < query_len) & (g < G)
    token = first_token + q0 + m
    head = kv_head * G + g
    pos = seq_len - query_len + q0 + m  # each query's position
    d = tl.arange(0, DP)
    in_dim = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=real[:, None] & in_dim[None, :],
        other=0.0,
    ).to(DOT)  # [R, DP]
    # the keys the tile's queries read: up to its last query's position, from its first query's window
    last = seq_len - query_len + tl.minimum(q0 + BLOCK_M, query_len) - 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - query_len + q0 - window + 1, 0)
        lo = lo // KEYS * KEYS
    row_max = tl.full([BLOCK_M * GP], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M * GP], tl.float32)
    acc = tl.zeros([BLOCK_M * GP, DP], tl.float32)
    for start in range(lo, last + 1, KEYS):
        k_pos = start + tl.arange(0, KEYS)
        present = k_pos <= last
        block = tl.load(tables_ptr + seq * stride_table + k_pos // BLOCK_SIZE, mask=present, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + k_pos % BLOCK_SIZE
        kv_offsets = kv_head * stride_kh + slot[:, None] * stride_ks + d[None, :]
        kv_mask = present[:, None] & in_dim[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT)  # [KEYS, DP]
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, KEYS] float32
        if HAS_SOFTCAP:
            # softcap * tanh(scores / softcap), tanh from exp (tl has no tanh on every backend)
            e = tl.exp(-2.0 * tl.abs(scores / softcap))
            t = (1.0 - e) / (1.0 + e)
            scores = softcap * tl.where(scores < 0, -t, t)
        allowed = k_pos[None, :] <= pos[:, None]
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > pos[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # a row that has seen no key yet (a window's start) keeps zeros, not exp(-inf + inf)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
        row_max = new_max
    if HAS_SINKS:  # one more logit in each softmax, with no value
        sink = tl.load(sinks_ptr + head, mask=real, other=0.0).to(tl.float32)
        new_max = tl.maximum(row_max, sink)
        correction = tl.exp(row_max - new_max)
        row_sum = row_sum * correction + tl.exp(sink - new_max)
        acc = acc * correction[:, None]
    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=real[:, None] & in_dim[None, :],
    )


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K/V are written
    block_tables: torch.Tensor  # [S, N] int32 of one KV group; padding and freed blocks -> block 0
    seqs: torch.Tensor  # [S, 3] int32: first flat token, query length, sequence length
    tiles: torch.Tensor  # [P, 2] int32: a program's sequence and first query in it
    block_size: int
    block_m: int  # queries per program

    def attend(
        self, q, k, v, k_cache, v_cache, rope, scale: float, window=None, softcap=None, sinks=None
    ) -> torch.Tensor:
        q = rotate_and_store(q, k, v, k_cache, v_cache, self.slot_mapping, rope)
        T, H, D = q.shape
        KVH = k_cache.shape[0]
        G = H // KVH
        out = torch.empty_like(q)
        dot = dot_dtype(q)
        grid = (self.tiles.shape[0], KVH)
        _paged_attention[grid](
            q, k_cache, v_cache, out, sinks if sinks is not None else q,
            self.block_tables, self.seqs, self.tiles,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            self.block_tables.stride(0),
            scale, softcap or 1.0, window or 0,
            G=G, GP=triton.next_power_of_2(G), BLOCK_M=self.block_m, HEAD_DIM=D, DP=max(triton.next_power_of_2(D), 16),
            BLOCK_SIZE=self.block_size, KEYS=KEY_TILE, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
            HAS_SINKS=sinks is not None, DOT=dot, PRECISION="ieee" if dot == tl.float32 else "tf32",
        )  # fmt: skip
        return out


class TritonAttention:
    """The GPU's paged attention (see the module's docstring); the same build() as the other backends."""

    min_query_len = 1

    def __init__(self, block_size: int, num_heads: int, group_kv_heads: Sequence[int], device: torch.device):
        """group_kv_heads: each KV group's KV heads, in the order of a sequence's block tables (Gemma 4's full
        layers have fewer than its sliding ones). A program holds at least MIN_ROWS query rows of one KV head
        (queries x that head's query heads), so a group whose heads are shared by fewer queries takes more queries
        a program: its own tiles."""
        self.block_size, self.device = block_size, torch.device(device)
        self.block_m = [max(1, MIN_ROWS // triton.next_power_of_2(num_heads // n)) for n in group_kv_heads]

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, device: torch.device) -> "TritonAttention":
        kv_heads = [group.num_kv_heads for group in config.kv_groups] or [config.num_kv_heads]
        return cls(block_size, config.num_heads, kv_heads, device)

    def build(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[TritonAttentionMetadata]]:
        """Flat positions [T] and the step's metadata, one per KV group (see TorchAttention.build), on the
        device."""
        positions, seqs, groups = kernel_tables(query_lens, seq_lens, block_tables, self.block_size)
        seqs = to_device(seqs, self.device)
        tiles = {}  # each program's (sequence, first query), per queries a program
        for m in set(self.block_m):
            starts = [(s, q0) for s, n in enumerate(query_lens) for q0 in range(0, n, m)]
            tiles[m] = to_device(torch.tensor(starts, dtype=torch.int32), self.device)
        metas = [
            TritonAttentionMetadata(
                to_device(slots, self.device),
                to_device(tables, self.device),
                seqs,
                tiles[m],
                self.block_size,
                m,
            )
            for (slots, tables), m in zip(groups, self.block_m, strict=True)
        ]
        return to_device(positions, self.device), metas


def error_against_pytorch(config: ModelConfig, block_size: int, dtype: torch.dtype, device) -> float:
    """The kernel's largest error against the PyTorch path's matmuls on a small mixed step (decodes and prefill
    chunks, scattered blocks), both in `dtype` on `device`, relative to the outputs' largest value, for each kind
    of the model's KV groups (window and head shape) on a cache laid out as the model's (strided where its groups'
    heads differ), with the soft-cap and sinks the model has: a check run once at start, so that a kernel this
    device's Triton miscompiles is never served."""
    g = torch.Generator().manual_seed(0)
    lens = [(1, 37), (1, 3), (9, 40), (6, 6)]  # (new tokens, context length)
    n = -(-max(b for _, b in lens) // block_size)  # each sequence's blocks, apart from the others'
    tables = [[1 + (n + 1) * i + j for j in range(n)] for i in range(len(lens))]
    num_blocks = 1 + (n + 1) * len(lens)
    caches = [KVCache(config, num_blocks, block_size, dtype, device) for _ in "ab"]
    for pool in (caches[0].k, caches[0].v):
        pool.copy_(torch.randn(pool.shape, generator=g))
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    T, H = sum(q for q, _ in lens), config.num_heads
    sink_logits = torch.randn(H, generator=g).to(device) if config.attn_sinks else None
    query_lens, seq_lens = [a for a, _ in lens], [b for _, b in lens]
    kinds = {(group.window, group.num_kv_heads, group.head_dim): group for group in config.kv_groups}
    worst = 0.0
    for (window, kv_heads, head_dim), group in kinds.items():
        q, k, v = (
            torch.randn(T, h, head_dim, generator=g).to(device, dtype) for h in (H, kv_heads, kv_heads)
        )
        kernel = TritonAttention(block_size, H, [kv_heads], device)
        pytorch = TorchAttention(
            block_size, kv_heads if config.uniform_kv else None, num_blocks, device, [window]
        )
        outs = []
        for backend, cache in zip((kernel, pytorch), caches, strict=True):
            _, metas = backend.build(query_lens, seq_lens, [[t] for t in tables])
            out = paged_attention(
                q, k, v, *cache.layer(group.layers[0]), metas[0], None, head_dim**-0.5, window, config.attn_softcap,
                sink_logits,
            )  # fmt: skip
            outs.append(out.float())
        worst = max(worst, ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item())
    return worst
