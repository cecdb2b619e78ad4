import pytest
import torch

from model.attention import MIN_INVARIANT_ROWS, attend, build_metadata, naive_attention, paged_attention


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
    k_cache = torch.zeros(num_blocks * block_size, kv_heads, head_dim, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    # the first ctx_len - q_len tokens are already cached; the last q_len are new this step
    _, prefix = build_metadata([ctx_len - q_len or 1], [ctx_len - q_len or 1], [table], block_size)
    if ctx_len > q_len:
        k_cache.index_copy_(0, prefix.slot_mapping, k_all[: ctx_len - q_len])
        v_cache.index_copy_(0, prefix.slot_mapping, v_all[: ctx_len - q_len])
    _, meta = build_metadata([q_len], [ctx_len], [table], block_size)
    scale = head_dim**-0.5
    out = paged_attention(q, k_all[-q_len:], v_all[-q_len:], k_cache, v_cache, meta, scale)
    ref = naive_attention(q, k_all, v_all, scale, causal_offset=ctx_len - q_len)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,min_rows", [(torch.bfloat16, 0), (torch.float32, MIN_INVARIANT_ROWS)])
def test_mixed_batch_equals_each_sequence_alone(dtype, min_rows):
    """Decodes and prefill chunks of several sequences in one flat call give each sequence's own result, bit for bit."""
    torch.manual_seed(0)
    H, KVH, D, bs = 6, 2, 16, 4
    lens = [(1, 9), (6, 6), (1, 30), (3, 17)]  # (new tokens, context length)
    tables = [[i * 8 + j for j in range(8)] for i in range(len(lens))]
    k_cache = torch.randn(128, KVH, D).to(dtype)
    v_cache = torch.randn(128, KVH, D).to(dtype)
    T = sum(q for q, _ in lens)
    q, k, v = (torch.randn(T, h, D).to(dtype) for h in (H, KVH, KVH))
    _, meta = build_metadata([a for a, _ in lens], [b for _, b in lens], tables, bs, min_rows=min_rows)
    out = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, D**-0.5)
    start = 0
    for (qlen, ctx), table in zip(lens, tables, strict=False):
        _, m1 = build_metadata([qlen], [ctx], [table], bs, min_rows=min_rows)
        s = slice(start, start + qlen)
        alone = paged_attention(q[s], k[s], v[s], k_cache.clone(), v_cache.clone(), m1, D**-0.5)
        assert torch.equal(out[s], alone)
        start += qlen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype,min_rows", [(torch.bfloat16, 0), (torch.float32, MIN_INVARIANT_ROWS)])
def test_rows_do_not_depend_on_padding(dtype, min_rows):
    """A row's output is bit-identical whatever the batch size and key padding of its group."""
    torch.manual_seed(1)
    B, H, KVH, D, L = 8, 9, 3, 64, 300
    q = torch.randn(B, 1, H, D).to(dtype)
    k, v = torch.randn(B, L, KVH, D).to(dtype), torch.randn(B, L, KVH, D).to(dtype)
    mask = torch.zeros(B, 1, 1, 1, L, dtype=torch.bool)
    mask[..., :100] = True
    alone = attend(q[:1], k[:1, :100], v[:1, :100], mask[:1, ..., :100], 0.125, min_rows)
    for b, length in [(1, 101), (1, 128), (8, 300)]:
        batched = attend(q[:b], k[:b, :length], v[:b, :length], mask[:b, ..., :length], 0.125, min_rows)
        assert torch.equal(batched[:1], alone)
