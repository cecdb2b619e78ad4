"""The amx tier's prompt queries on AMX's bfloat16 tiles (model/csrc/paged_attention_amx.cpp): right against the
textbook formula at bfloat16's precision, the same bits for a query in any chunk or batch, and every other row
left to the exact vector kernel. On AMX hosts on the instructions; on AVX-512 BF16 hosts without them on the
software model of the tiles (model/csrc/amx.h), which runs the same kernel code."""

import pytest
import torch

from model import cpu_tier
from model.attention import naive_attention
from model.kernels import load

RUNS = [name for name, tiers in (("hardware", cpu_tier.runnable()), ("emulated", cpu_tier.emulated())) if "amx" in
        [t.name for t in tiers]]  # fmt: skip


@pytest.fixture(params=RUNS or [pytest.param(None, marks=pytest.mark.skip(reason="no AVX-512 BF16 here"))])
def tiles(request):
    """(the amx module, emulate_tiles) for the kind of tiles this host runs."""
    return load("amx"), request.param == "emulated"


def cached(ctx_len, kv_heads, head_dim, table, block_size, seed=0):
    """K/V of a sequence of ctx_len tokens, in the cache's dtype (bfloat16) through a scattered block table;
    the rest of the pool holds other sequences' keys."""
    g = torch.Generator().manual_seed(seed)
    num_slots = (max(table) + 1) * block_size
    k_cache, v_cache = (torch.randn(kv_heads, num_slots, head_dim, generator=g).bfloat16() for _ in range(2))
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx_len)])
    return k_cache, v_cache, k_cache[:, slots].transpose(0, 1), v_cache[:, slots].transpose(0, 1)


def attend(tiles, q, k_cache, v_cache, lens, tables, block_size, prompt_runs, window=0, softcap=0.0, sinks=None,
           chunk=16):  # fmt: skip
    """The kernel over sequences given as (query length, sequence length), q laid out flat; prompt_runs: the
    rows [start, end) to run on tiles (None: every row on vectors)."""
    kernels, emulate = tiles
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seqs, first = [], 0
    for q_len, seq_len in lens:
        seqs.append([first, q_len, seq_len])
        first += q_len
    seqs = torch.tensor(seqs, dtype=torch.int32)
    scale = q.shape[-1] ** -0.5
    args = (q, k_cache, v_cache, block_tables, seqs, block_size, scale, window, softcap, chunk)
    if prompt_runs is None:
        return kernels.paged_attention(*args, None, None, None, None, None, sinks)
    runs = torch.tensor(prompt_runs, dtype=torch.int64).view(-1, 2)
    return kernels.paged_attention(*args, None, None, None, None, None, sinks, runs, emulate)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (4, 4, 64), (2, 1, 256)])
@pytest.mark.parametrize("q_len,ctx_len,window,block_size", [(40, 40, 0, 16), (37, 70, 0, 4), (40, 90, 23, 16),
                                                             (1, 33, 0, 16)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_queries_on_tiles_equal_the_textbook_formula(
    tiles, heads, kv_heads, head_dim, q_len, ctx_len, window, block_size, dtype
):
    torch.manual_seed(heads + q_len)
    table = torch.randperm(40)[: (ctx_len + block_size - 1) // block_size].tolist()
    k_cache, v_cache, k_all, v_all = cached(ctx_len, kv_heads, head_dim, table, block_size, seed=q_len)
    q = torch.randn(q_len, heads, head_dim).to(dtype)
    out = attend(tiles, q, k_cache, v_cache, [(q_len, ctx_len)], [table], block_size, [0, q_len], window)
    assert out.dtype == dtype and out.shape == q.shape
    for i in range(q_len):
        pos = ctx_len - q_len + i
        lo = max(0, pos - window + 1) if window else 0
        ref = naive_attention(
            q[i : i + 1], k_all[lo : pos + 1], v_all[lo : pos + 1], head_dim**-0.5, pos - lo
        )
        # q and the probabilities rounded to bfloat16 (8 bits), sums in float32: outputs within ~1% of |v|
        torch.testing.assert_close(out[i : i + 1].double(), ref, rtol=0, atol=3e-2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("softcap,with_sinks", [(30.0, False), (0.0, True)])
def test_soft_caps_and_sinks_on_tiles_as_on_vectors(tiles, softcap, with_sinks):
    """Gemma 2's soft-capped scores and GPT-OSS's sinks (one far above every score, one far below) run on the
    tiles as the vector kernel runs them, to bfloat16's precision."""
    torch.manual_seed(3)
    H, KVH, D, bs, n = 6, 2, 64, 16, 50
    table = list(range(4))
    k_cache, v_cache, _, _ = cached(n, KVH, D, table, bs)
    q = torch.randn(n, H, D) * 3  # scores large enough for the cap to bite
    sinks = torch.tensor([0.5, -1.0, 40.0, -40.0, 2.0, 0.0]) if with_sinks else None
    on_vectors = attend(tiles, q, k_cache, v_cache, [(n, n)], [table], bs, None, 0, softcap, sinks)
    on_tiles = attend(tiles, q, k_cache, v_cache, [(n, n)], [table], bs, [0, n], 0, softcap, sinks)
    torch.testing.assert_close(on_tiles, on_vectors, rtol=0, atol=3e-2)
    assert not torch.equal(on_tiles, on_vectors)  # the tiles' bfloat16 rounding shows
    if with_sinks:
        assert on_tiles[:, 2].abs().max() < 1e-12 < on_tiles[:, 3].abs().max()


@pytest.mark.timeout(300)
def test_a_prompt_query_gets_the_same_bits_in_any_chunk_or_batch(tiles):
    """A prompt's rows on tiles are computed each from its own row alone: prefilled whole, in chunks of any size
    (the kernel's units cut them differently too), or beside other sequences' prompts and decodes, a query's
    output has the same bits."""
    torch.manual_seed(6)
    H, KVH, D, bs, n = 9, 3, 64, 16, 75
    table = [5, 0, 3, 7, 2]
    k_cache, v_cache, _, _ = cached(n, KVH, D, list(range(16)), bs)
    q = torch.randn(n, H, D)
    other_q = torch.randn(40, H, D)

    def run(chunks, neighbours, window=0, unit=16):
        outs, done = [], 0
        for c in chunks:
            # this sequence's prompt chunk first, then neighbours: decodes (vectors) and 7-token prompt chunks
            lens = [(c, done + c)] + [(1 if j % 2 else 7, 20 + j) for j in range(neighbours)]
            tables = [table] + [[8 + j % 8, 9 + j % 7] for j in range(neighbours)]
            runs, row = [0, c], c
            for q_len, _ in lens[1:]:
                if q_len > 1:
                    runs += [row, row + q_len]
                row += q_len
            x = torch.cat([q[done : done + c], other_q[: row - c]])
            outs.append(attend(tiles, x, k_cache, v_cache, lens, tables, bs, runs, window, chunk=unit)[:c])
            done += c
        return torch.cat(outs)

    for window in (0, 29):
        full = run([n], 0, window)
        for chunks, neighbours, unit in (([n], 3, 16), ([5, 1, 1, 16, 52], 1, 16), ([17, 17, 41], 4, 5),
                                         ([3, 5, 2, 65], 0, 64)):  # fmt: skip
            assert torch.equal(run(chunks, neighbours, window, unit), full), (chunks, neighbours, window)


@pytest.mark.timeout(300)
def test_rows_not_named_keep_the_vector_kernels_bits(tiles):
    """Only the rows prompt_runs names run on tiles: a step's decodes, and a prompt's rows where a head's values
    do not fill whole tiles (head size 80), have the vector kernel's bits."""
    torch.manual_seed(2)
    for D, named_differ in ((64, True), (80, False)):
        H, KVH, bs = 4, 2, 16
        lens, tables = [(30, 30), (1, 50), (1, 17)], [[0, 1], [2, 3, 4, 5], [6, 7]]
        k_cache, v_cache, _, _ = cached(1, KVH, D, list(range(8)), bs)
        q = torch.randn(32, H, D)
        exact = attend(tiles, q, k_cache, v_cache, lens, tables, bs, None)
        mixed = attend(tiles, q, k_cache, v_cache, lens, tables, bs, [0, 30])
        assert torch.equal(mixed[30:], exact[30:])
        assert torch.equal(mixed[:30], exact[:30]) != named_differ, D
        torch.testing.assert_close(mixed, exact, rtol=0, atol=3e-2)


@pytest.mark.timeout(300)
def test_a_cache_whose_slots_hold_every_head_reads_the_same(tiles):
    """Where a model's layers differ in heads, a slot holds every head's K/V side by side (model/kv_cache.py): the
    tiles read a key's row at the slot's stride and give the bits they give on a cache of one head's rows."""
    torch.manual_seed(9)
    H, KVH, D, bs, n = 6, 2, 64, 16, 45
    table = [3, 1, 0]
    k_cache, v_cache, _, _ = cached(n, KVH, D, table, bs)
    wide = [torch.zeros(k_cache.shape[1], KVH * D + 32, dtype=torch.bfloat16) for _ in range(2)]
    views = []
    for pool, cache in zip(wide, (k_cache, v_cache), strict=True):
        view = pool.as_strided(cache.shape, (D, pool.shape[1], 1))  # [KVH, slots, D], a slot's heads together
        view.copy_(cache)
        views.append(view)
    q = torch.randn(n, H, D)
    alone = attend(tiles, q, k_cache, v_cache, [(n, n)], [table], bs, [0, n])
    strided = attend(tiles, q, *views, [(n, n)], [table], bs, [0, n])
    assert torch.equal(strided, alone)


@pytest.mark.timeout(120)
def test_the_tiles_are_refused_off_the_amx_tier(tier_kernels):
    """Only the amx tier's module has the tile kernel; the others refuse a step that names prompt rows rather
    than run them as something else."""
    if tier_kernels.gemm_dequantized:
        return  # the amx tier: the tests above
    q = torch.randn(3, 2, 64)
    cache = torch.zeros(2, 16, 64, dtype=torch.bfloat16)
    seqs, table = torch.tensor([[0, 3, 3]], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="amx tier only"):
        tier_kernels.paged_attention(q, cache, cache, table, seqs, 16, 0.125, 0, 0.0, 16, None, None, None, None,
                                     None, None, torch.tensor([[0, 3]]))  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    "amx" not in [t.name for t in cpu_tier.runnable()], reason="AMX: Xeons that have its tiles"
)
def test_the_tile_instructions_compute_what_their_model_does():
    """On an AMX host the instructions and the software model the tests elsewhere run give the same outputs
    to float32's rounding of the scores (TDPBF16PS's own sums are wider than float32: not the same bits)."""
    torch.manual_seed(4)
    H, KVH, D, bs, n = 9, 3, 64, 16, 100
    table = list(range(7))
    k_cache, v_cache, _, _ = cached(n, KVH, D, table, bs)
    q = torch.randn(n, H, D)
    kernels = load("amx")
    hardware = attend((kernels, False), q, k_cache, v_cache, [(n, n)], [table], bs, [0, n], 31)
    model = attend((kernels, True), q, k_cache, v_cache, [(n, n)], [table], bs, [0, n], 31)
    torch.testing.assert_close(hardware, model, rtol=0, atol=1e-2)
    assert (hardware == model).float().mean() > 0.5
