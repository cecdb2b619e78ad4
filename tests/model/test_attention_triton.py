"""model/attention_triton.py, the GPU's paged attention kernel, run on the CPU by Triton's interpreter (its own
code, numpy's arithmetic): against the textbook formula, and against the PyTorch path for windows, soft-caps and
sinks, in a step that mixes decodes and prefill chunks as the engine's do."""

import pytest
import torch

from model.attention import TorchAttention, naive_attention, paged_attention

pytestmark = pytest.mark.usefixtures("triton_here")


def build(query_lens, seq_lens, tables, block_size, heads, kv_heads, cache, window=None, triton=True):
    """The step's positions and metadata (one KV group) from the Triton backend or the PyTorch one."""
    if triton:
        from model.attention_triton import TritonAttention

        backend = TritonAttention(block_size, heads, [kv_heads], "cpu")
    else:
        backend = TorchAttention(block_size, kv_heads, cache.shape[1] // block_size, "cpu", [window])
    positions, metas = backend.build(query_lens, seq_lens, [[t] for t in tables])
    return positions, metas[0]


def random_step(lens, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Sequences of (new tokens, context length) on scattered blocks of one cache whose earlier tokens are
    written: the step's q/k/v, the cache, the tables, and every sequence's whole K/V (for the formula)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // block_size) for _, ctx in lens) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, k_cache, v_cache = [], torch.zeros(kv_heads, num_blocks * block_size, head_dim, dtype=dtype), None
    v_cache = torch.zeros_like(k_cache)
    whole, new = [], []
    for qlen, ctx in lens:
        n = -(-ctx // block_size)
        tables.append([order.pop() for _ in range(n)])
        k_all, v_all = (torch.randn(ctx, kv_heads, head_dim, generator=g).to(dtype) for _ in "kv")
        slots = [tables[-1][p // block_size] * block_size + p % block_size for p in range(ctx - qlen)]
        k_cache[:, slots], v_cache[:, slots] = (
            k_all[: ctx - qlen].transpose(0, 1),
            v_all[: ctx - qlen].transpose(0, 1),
        )
        whole.append((k_all, v_all))
        new.append(
            (
                torch.randn(qlen, heads, head_dim, generator=g).to(dtype),
                k_all[ctx - qlen :],
                v_all[ctx - qlen :],
            )
        )
    q, k, v = (torch.cat([x[i] for x in new]) for i in range(3))
    return q, k, v, k_cache, v_cache, tables, whole


MIXED = [(1, 1), (1, 37), (5, 5), (7, 40), (33, 33), (1, 70), (19, 52)]  # (new tokens, context length)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (9, 3, 64), (6, 1, 80)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_mixed_step_equals_the_textbook_formula(heads, kv_heads, head_dim, block_size):
    """Decodes and prefill chunks of several sequences in one call, through scattered block tables: each query
    gets softmax(q k^T * scale) v over its sequence's keys up to its position, and the new K/V are in the cache."""
    q, k, v, k_cache, v_cache, tables, whole = random_step(
        MIXED, heads, kv_heads, head_dim, block_size, torch.float32, 1
    )
    _, meta = build(
        [a for a, _ in MIXED], [b for _, b in MIXED], tables, block_size, heads, kv_heads, k_cache
    )
    scale = head_dim**-0.5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, None, scale)
    start = 0
    for (qlen, ctx), (k_all, v_all), table in zip(MIXED, whole, tables, strict=True):
        ref = naive_attention(q[start : start + qlen], k_all, v_all, scale, causal_offset=ctx - qlen)
        torch.testing.assert_close(out[start : start + qlen], ref.float(), rtol=1e-5, atol=1e-5)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        assert torch.equal(k_cache[:, slots], k_all.transpose(0, 1))  # the step's K written where they belong
        start += qlen


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "window,softcap,sinks",
    [(5, None, False), (None, 30.0, False), (None, None, True), (24, None, True), (7, 20.0, True)],
)
def test_windows_softcaps_and_sinks_as_the_pytorch_path(window, softcap, sinks):
    """Sliding windows (a window's earlier blocks freed: -1 in the table), Gemma 2's soft-cap and GPT-OSS's sinks
    give what the PyTorch path gives, in the same mixed step."""
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 4
    q, k, v, k_cache, v_cache, tables, _ = random_step(
        MIXED, heads, kv_heads, head_dim, block_size, torch.float32, 2
    )
    if window is not None:  # blocks wholly behind every new query's window are given back
        for (qlen, ctx), table in zip(MIXED, tables, strict=True):
            for b in range(max(0, ctx - qlen - window + 1) // block_size):
                table[b] = -1
    sink_logits = torch.randn(heads, generator=torch.Generator().manual_seed(3)) if sinks else None
    lens = ([a for a, _ in MIXED], [b for _, b in MIXED])
    outs = []
    for triton in (True, False):
        _, meta = build(*lens, tables, block_size, heads, kv_heads, k_cache, window, triton)
        outs.append(
            paged_attention(
                q, k, v, k_cache.clone(), v_cache.clone(), meta, None, 0.2, window, softcap, sink_logits
            )
        )
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_bfloat16_stays_within_its_rounding_of_float32():
    """A GPU's dtype: bfloat16 q and cache, float32 scores and softmax inside the kernel (on the CPU the
    interpreter's dots take float32 inputs: it multiplies bfloat16 ones wrongly)."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    q, k, v, k_cache, v_cache, tables, _ = random_step(
        MIXED, heads, kv_heads, head_dim, block_size, torch.float32, 4
    )
    lens = ([a for a, _ in MIXED], [b for _, b in MIXED])
    _, meta = build(*lens, tables, block_size, heads, kv_heads, k_cache)
    exact = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, None, 0.125)
    bf16 = paged_attention(*(x.bfloat16() for x in (q, k, v, k_cache, v_cache)), meta, None, 0.125)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), exact, rtol=0.02, atol=0.02)
