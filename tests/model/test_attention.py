import pytest
import torch

from model.attention import (
    TorchAttention,
    apply_rope,
    attend,
    attend_sdpa,
    min_query_len_for_invariance,
    naive_attention,
    paged_attention,
)
from model.attention_cpu import CpuKernelAttention, CpuKernelMetadata
from model.invariance import MIN_INVARIANT_ROWS, rows_for_invariance
from model.kernels import cpu_kernels


def build_metadata(
    query_lens,
    seq_lens,
    tables,
    block_size,
    sliding_window=None,
    min_query_len=1,
    cpu_kernel=False,
    cache=None,
    kernels=None,
):
    """The step's positions and metadata from the C++ kernel's backend or the PyTorch one (which needs the
    geometry of the cache it will read, and the window it will be asked for: pass them)."""
    if cpu_kernel:
        backend = CpuKernelAttention(kernels or cpu_kernels(), block_size)
    else:
        kv_heads, num_slots = cache.shape[:2] if cache is not None else (1, block_size)
        backend = TorchAttention(
            block_size, kv_heads, num_slots // block_size, "cpu", [sliding_window], min_query_len
        )
    positions, metas = backend.build(query_lens, seq_lens, [[t] for t in tables])  # one KV group
    return positions, metas[0]


def empty_cache(num_slots, kv_heads, head_dim, dtype):
    return torch.zeros(kv_heads, num_slots, head_dim, dtype=dtype), torch.zeros(
        kv_heads, num_slots, head_dim, dtype=dtype
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (9, 3, 64), (6, 1, 8)])
@pytest.mark.parametrize("q_len,ctx_len", [(1, 1), (1, 37), (5, 5), (7, 40), (33, 33)])
def test_paged_attention_equals_textbook_formula(heads, kv_heads, head_dim, q_len, ctx_len):
    torch.manual_seed(heads * 100 + q_len)
    block_size, num_blocks = 4, 32
    # a scattered, non-contiguous block table
    table = torch.randperm(num_blocks)[: (ctx_len + block_size - 1) // block_size].tolist()
    k_all = torch.randn(ctx_len, kv_heads, head_dim, dtype=torch.float64)
    v_all = torch.randn(ctx_len, kv_heads, head_dim, dtype=torch.float64)
    q = torch.randn(q_len, heads, head_dim, dtype=torch.float64)
    k_cache, v_cache = empty_cache(num_blocks * block_size, kv_heads, head_dim, torch.float64)
    # the first ctx_len - q_len tokens are already cached; the last q_len are new this step
    if ctx_len > q_len:
        _, prefix = build_metadata([ctx_len - q_len], [ctx_len - q_len], [table], block_size)
        k_cache.index_copy_(1, prefix.slot_mapping, k_all[: ctx_len - q_len].transpose(0, 1))
        v_cache.index_copy_(1, prefix.slot_mapping, v_all[: ctx_len - q_len].transpose(0, 1))
    _, meta = build_metadata([q_len], [ctx_len], [table], block_size, cache=k_cache)
    scale = head_dim**-0.5
    out = paged_attention(q, k_all[-q_len:], v_all[-q_len:], k_cache, v_cache, meta, None, scale)
    ref = naive_attention(q, k_all, v_all, scale, causal_offset=ctx_len - q_len)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(60)
def test_sliding_window_limits_the_keys():
    torch.manual_seed(2)
    H, D, bs, n, window = 2, 8, 4, 20, 5
    k, v, q = (torch.randn(n, H, D, dtype=torch.float64) for _ in range(3))
    k_cache, v_cache = empty_cache(32, H, D, torch.float64)
    _, meta = build_metadata([n], [n], [list(range(8))], bs, sliding_window=window, cache=k_cache)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, None, 0.3, window)
    for i in (0, 7, 19):  # query i sees keys i-window+1 .. i
        lo = max(0, i - window + 1)
        ref = naive_attention(q[i : i + 1], k[lo : i + 1], v[lo : i + 1], 0.3, causal_offset=i - lo)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_batch_equals_each_sequence_alone(dtype):
    """Decodes and prefill chunks of several sequences in one flat call give each sequence's own result, bit for bit."""
    torch.manual_seed(0)
    H, KVH, D, bs = 6, 2, 16, 4
    min_query_len = min_query_len_for_invariance(H, KVH, D, dtype)
    lens = [(1, 9), (6, 6), (1, 30), (3, 17), (1, 70)]  # (new tokens, context length)
    tables = [[i * 20 + j for j in range(20)] for i in range(len(lens))]
    k_cache = torch.randn(KVH, 400, D).to(dtype)
    v_cache = torch.randn(KVH, 400, D).to(dtype)
    T = sum(q for q, _ in lens)
    q, k, v = (torch.randn(T, h, D).to(dtype) for h in (H, KVH, KVH))
    _, meta = build_metadata(
        [a for a, _ in lens], [b for _, b in lens], tables, bs, min_query_len=min_query_len, cache=k_cache
    )
    out = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, None, D**-0.5)
    start = 0
    for (qlen, ctx), table in zip(lens, tables, strict=True):
        _, m1 = build_metadata([qlen], [ctx], [table], bs, min_query_len=min_query_len, cache=k_cache)
        s = slice(start, start + qlen)
        alone = paged_attention(q[s], k[s], v[s], k_cache.clone(), v_cache.clone(), m1, None, D**-0.5)
        assert torch.equal(out[s], alone)
        start += qlen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_queries_equal_one_chunk(dtype):
    """A prompt's attention computed in chunks of any size equals one pass, bit for bit (the chunking invariance
    the engine relies on), with each chunk's keys read back from the cache."""
    torch.manual_seed(4)
    H, KVH, D, bs, n = 9, 3, 64, 16, 45
    min_query_len = min_query_len_for_invariance(H, KVH, D, dtype)
    q, k, v = (torch.randn(n, h, D).to(dtype) for h in (H, KVH, KVH))
    table = [3, 0, 2]

    def run(chunks):
        k_cache, v_cache = empty_cache(64, KVH, D, dtype)
        outs, done = [], 0
        for c in chunks:
            _, meta = build_metadata([c], [done + c], [table], bs, min_query_len=min_query_len, cache=k_cache)
            s = slice(done, done + c)
            outs.append(paged_attention(q[s], k[s], v[s], k_cache, v_cache, meta, None, D**-0.5))
            done += c
        return torch.cat(outs)

    full = run([n])
    for chunks in ([1] * n, [5, 1, 1, 38], [16, 16, 13], [44, 1]):
        assert torch.equal(run(chunks), full), chunks


@pytest.mark.timeout(60)
def test_sdpa_path_equals_the_matmul_path():
    """GPUs use torch's fused SDPA; it must compute what the CPU path computes."""
    torch.manual_seed(5)
    B, Q, H, KVH, D, L = 3, 5, 8, 2, 16, 32
    q = torch.randn(B, Q, H, D, dtype=torch.float64)
    k, v = torch.randn(B, KVH, L, D, dtype=torch.float64), torch.randn(B, KVH, L, D, dtype=torch.float64)
    masked = torch.rand(B, 1, Q, 1, L) < 0.3
    masked[..., 0] = False
    torch.testing.assert_close(attend_sdpa(q, k, v, masked, 0.25), attend(q, k, v, masked, 0.25))


@pytest.mark.timeout(30)
def test_rows_for_invariance_finds_the_padding_a_kernel_needs():
    x = torch.randn(64, 8)

    def kernel_switching_below(rows):  # a GEMM that sums in another order for small batches
        return lambda a: a * 3 + (1e-3 if len(a) < rows else 0.0)

    assert rows_for_invariance(kernel_switching_below(1), x) == 1
    assert rows_for_invariance(kernel_switching_below(2), x) == 2
    assert rows_for_invariance(kernel_switching_below(3), x) == 4
    assert rows_for_invariance(kernel_switching_below(64), x) == MIN_INVARIANT_ROWS  # the most it pads

    def one_row_in_twenty_differs_alone(a):
        out = a * 3
        if len(a) == 1 and a[0, 0] > 1.6:  # ~5% of rows
            out = out + 1e-3
        return out

    assert rows_for_invariance(one_row_in_twenty_differs_alone, x) == 2


# The C++ kernel (model/csrc/paged_attention.cpp): the CPU path by default.

# (activations, KV cache): each tier's pairs (cpu_tier.py: a bfloat16 cache under float32 activations)
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]


def kernel_attention(kernels, q, k, v, k_cache, v_cache, lens, tables, block_size, window=None):
    """The kernel over sequences given as (new tokens, context length) pairs, laid out flat in q/k/v."""
    _, meta = build_metadata([a for a, _ in lens], [b for _, b in lens], tables, block_size, sliding_window=window,
                             cpu_kernel=True, kernels=kernels)  # fmt: skip
    assert isinstance(meta, CpuKernelMetadata)
    return paged_attention(q, k, v, k_cache, v_cache, meta, None, q.shape[-1] ** -0.5, window)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (9, 3, 64), (6, 1, 8), (4, 2, 128)]
)
@pytest.mark.parametrize("q_len,ctx_len,window", [(1, 1, None), (1, 37, None), (7, 40, None), (33, 33, None),
                                                  (40, 70, 9), (1, 70, 17)])  # fmt: skip
@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
def test_cpu_kernel_equals_textbook_formula(
    tier_kernels, heads, kv_heads, head_dim, q_len, ctx_len, window, dtype, cache_dtype
):
    torch.manual_seed(heads * 100 + q_len)
    block_size, num_blocks = 4, 32
    table = torch.randperm(num_blocks)[: (ctx_len + block_size - 1) // block_size].tolist()
    # keys and values as the cache holds them (rounded to its dtype), handed in the activations' dtype
    k_all, v_all = (torch.randn(ctx_len, kv_heads, head_dim).to(cache_dtype).to(dtype) for _ in range(2))
    q = torch.randn(q_len, heads, head_dim).to(dtype)
    k_cache, v_cache = empty_cache(num_blocks * block_size, kv_heads, head_dim, cache_dtype)
    if ctx_len > q_len:
        _, prefix = build_metadata([ctx_len - q_len], [ctx_len - q_len], [table], block_size)
        k_cache.index_copy_(1, prefix.slot_mapping, k_all[: ctx_len - q_len].transpose(0, 1).to(cache_dtype))
        v_cache.index_copy_(1, prefix.slot_mapping, v_all[: ctx_len - q_len].transpose(0, 1).to(cache_dtype))
    out = kernel_attention(tier_kernels, q, k_all[-q_len:], v_all[-q_len:], k_cache, v_cache, [(q_len, ctx_len)],
                           [table], block_size, window)  # fmt: skip
    assert out.dtype == dtype and out.shape == q.shape
    scale = head_dim**-0.5
    for i in range(q_len):  # query i (position ctx_len - q_len + i) sees keys lo .. its position
        pos = ctx_len - q_len + i
        lo = max(0, pos - window + 1) if window else 0
        ref = naive_attention(
            q[i : i + 1], k_all[lo : pos + 1], v_all[lo : pos + 1], scale, causal_offset=pos - lo
        )
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=tol, atol=tol)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
def test_cpu_kernel_gives_each_query_the_same_bits_in_any_batch_or_chunking(tier_kernels, dtype, cache_dtype):
    """A sequence's outputs are bit-identical whether its tokens come in one pass, in chunks of any size, one
    decode at a time, or beside other sequences' decodes and chunks (no padding needed for that)."""
    torch.manual_seed(6)
    H, KVH, D, bs, n = 9, 3, 64, 16, 75
    q, k, v = (torch.randn(n, h, D).to(dtype) for h in (H, KVH, KVH))
    table = [5, 0, 3, 7, 2]
    other_q, other_k, other_v = (torch.randn(20, h, D).to(dtype) for h in (H, KVH, KVH))

    def run(chunks, neighbours):
        k_cache, v_cache = empty_cache(16 * bs, KVH, D, cache_dtype)
        k_cache[:, 8 * bs :] = torch.randn(KVH, 8 * bs, D).to(cache_dtype)  # other sequences' keys
        v_cache[:, 8 * bs :] = torch.randn(KVH, 8 * bs, D).to(cache_dtype)
        outs, done = [], 0
        for c in chunks:
            # this sequence first, then `neighbours` other sequences (1-token decodes or 7-token chunks)
            lens = [(c, done + c)] + [(1 if j % 2 else 7, 20 + j) for j in range(neighbours)]
            tables = [table] + [[8 + j % 8, 9 + j % 7] for j in range(neighbours)]
            extra = sum(a for a, _ in lens[1:])
            s = slice(done, done + c)
            out = kernel_attention(
                tier_kernels, torch.cat([q[s], other_q[:extra]]), torch.cat([k[s], other_k[:extra]]),
                torch.cat([v[s], other_v[:extra]]), k_cache, v_cache, lens, tables, bs,
            )  # fmt: skip
            outs.append(out[:c])
            done += c
        return torch.cat(outs)

    full = run([n], 0)
    for chunks, neighbours in (
        ([n], 3),
        ([1] * n, 0),
        ([1] * n, 2),
        ([5, 1, 1, 16, 52], 1),
        ([17, 17, 41], 4),
        ([3, 5, 2, 65], 0),  # a lone sequence's few queries: the kernel splits them into smaller units
    ):
        assert torch.equal(run(chunks, neighbours), full), (chunks, neighbours)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_rotates_and_stores_as_the_pytorch_path_does(tier_kernels, dtype):
    """Given the new k and v and the rotary cos/sin, the kernel rotates q and k, writes k and v by slot and
    attends in one call: what PyTorch's apply_rope + index_copy_ + the kernel give (up to rounding)."""
    torch.manual_seed(8)
    H, KVH, D, bs = 6, 2, 16, 4
    lens = [(1, 9), (5, 5), (3, 17)]  # (new tokens, context length)
    tables = [[i * 8 + j for j in range(8)] for i in range(len(lens))]
    T = sum(a for a, _ in lens)
    q, k, v = (torch.randn(T, h, D).to(dtype) for h in (H, KVH, KVH))
    angles = torch.rand(T, D // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)[:, None]
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)[:, None]
    caches = torch.randn(2, KVH, 24 * bs, D).to(dtype)
    _, meta = build_metadata([a for a, _ in lens], [b for _, b in lens], tables, bs, cpu_kernel=True,
                             kernels=tier_kernels)  # fmt: skip
    fused_k, fused_v = caches[0].clone(), caches[1].clone()
    fused = paged_attention(q, k, v, fused_k, fused_v, meta, (cos, sin), D**-0.5)
    apart_k, apart_v = caches[0].clone(), caches[1].clone()
    kr = apply_rope(k.float(), cos.float(), sin.float()).to(dtype)
    apart_k.index_copy_(1, meta.slot_mapping, kr.transpose(0, 1))
    apart_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    qr = apply_rope(q.float(), cos.float(), sin.float()).to(dtype)
    apart = meta.kernel(qr, apart_k, apart_v, meta.block_tables, meta.seqs, bs, D**-0.5, 0, 0.0, 16)
    assert torch.equal(fused_v, apart_v)
    # the kernel may fuse a product and a sum (one rounding fewer): keys within one step of the target dtype
    step = 2**-22 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(fused_k.float(), apart_k.float(), rtol=step, atol=step)
    assert (fused_k == apart_k).float().mean() > 0.95
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the fused path keeps rotated q unrounded
    torch.testing.assert_close(fused.float(), apart.float(), rtol=tol, atol=tol)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["pytorch", "cpu_kernel"])
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_join_each_softmax_and_take_no_value(tier_kernels, path, window):
    """GPT-OSS's sinks, a logit per head in every softmax's denominator, on both CPU paths against the textbook
    formula; one head's sink far above every score (its outputs shrink towards 0, with no overflow), one far below
    (plain attention)."""
    torch.manual_seed(5)
    H, KVH, D, bs, n = 6, 2, 16, 4, 23
    sinks = torch.tensor([0.5, -1.0, 40.0, -40.0, 2.0, 0.0])
    k, v, q = (torch.randn(n, h, D) for h in (KVH, KVH, H))
    k_cache, v_cache = empty_cache(32, KVH, D, torch.float32)
    kernels = tier_kernels if path == "cpu_kernel" else None
    _, meta = build_metadata([n], [n], [list(range(8))], bs, sliding_window=window, cpu_kernel=kernels is not None,
                             cache=k_cache, kernels=kernels)  # fmt: skip
    out = paged_attention(q, k, v, k_cache, v_cache, meta, None, D**-0.5, window, None, sinks)
    for i in range(n):
        lo = max(0, i - window + 1) if window else 0
        ref = naive_attention(q[i : i + 1], k[lo : i + 1], v[lo : i + 1], D**-0.5, i - lo, sinks)
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=1e-5, atol=1e-6)
    assert out[:, 2].abs().max() < 1e-12 < out[:, 3].abs().max()
