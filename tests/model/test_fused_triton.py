"""The GPU's fused kernels (model/fused_triton.py) under Triton's interpreter: each against the PyTorch ops it
stands for, on the layouts a step hands them (views of a fused projection, rows of any count, a cache's slots).
The interpreter rounds float32 to bfloat16 by truncation (numpy has no bfloat16; a GPU rounds to nearest), so
16-bit results are held to a unit in the last place, not to the bit."""

import pytest
import torch
import torch.nn.functional as F

from model.attention import apply_rope, rotate_and_store
from model.fused_triton import rms_norm, silu_mul
from model.fused_triton import rotate_and_store as fused_rotate_and_store

pytestmark = pytest.mark.usefixtures("triton_here")


def rows(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 200])
def test_rms_norm_with_and_without_its_residual_and_weight(dtype, n):
    x, residual, weight = (
        rows(5, n, dtype=dtype),
        rows(5, n, dtype=dtype, seed=1),
        rows(n, dtype=dtype, seed=2),
    )
    total = x + residual  # rounded to the dtype, as the stream is
    normed, summed = rms_norm(x, residual, weight, 1e-6)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(summed, total, **tolerance)
    expected = F.rms_norm(summed.float(), (n,), weight.float(), 1e-6).to(dtype)
    torch.testing.assert_close(normed, expected, **tolerance)
    alone, same = rms_norm(x, None, None, 1e-6)  # no residual, no weight (Gemma 4's value heads)
    assert same is x
    torch.testing.assert_close(alone, F.rms_norm(x.float(), (n,), None, 1e-6).to(dtype), **tolerance)


def test_rms_norm_reads_strided_rows_and_none():
    wide = rows(4, 96)
    x = wide[:, :64]  # rows a fused projection's view leaves apart
    normed, _ = rms_norm(x, None, torch.ones(64), 1e-5)
    torch.testing.assert_close(normed, F.rms_norm(x, (64,), None, 1e-5))
    empty, _ = rms_norm(rows(0, 64), rows(0, 64), torch.ones(64), 1e-5)
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_times_up(dtype):
    h = rows(3, 2 * 1500, dtype=dtype)  # past one program's outputs, not a multiple of them
    gate, up = h.float().chunk(2, dim=-1)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(silu_mul(h), (F.silu(gate) * up).to(dtype), **tolerance)


def rope_tables(positions, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.tensor(positions).float()[:, None] * inv_freq
    return torch.cat((freqs.cos(),) * 2, -1)[:, None], torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None]


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rope_and_store_match_pytorchs_ops_on_a_fused_projections_views(rotated, head_dim):
    """Queries and keys rotated, keys and values written into the cache at the tokens' slots: the same values as
    model/attention.py's rotate_and_store, the cache's other slots untouched."""
    T, H, KVH, D, slots = 5, 4, 2, head_dim, 40
    qkv = rows(T, (H + 2 * KVH) * D).view(T, H + 2 * KVH, D)
    q, k, v = qkv.split_with_sizes((H, KVH, KVH), dim=1)
    rope = rope_tables([3, 4, 9, 10, 11], D) if rotated else None
    slot_mapping = torch.tensor([7, 8, 21, 22, 23])
    caches = [[rows(KVH, slots, D, seed=5), rows(KVH, slots, D, seed=6)] for _ in range(2)]
    q_torch, _ = rotate_and_store(q, k, v, *caches[0], slot_mapping, rope)
    q_fused = fused_rotate_and_store(q, k, v, *caches[1], slot_mapping, rope)
    assert q_fused.is_contiguous()
    torch.testing.assert_close(q_fused, q_torch, atol=1e-6, rtol=1e-6)
    for torch_cache, fused_cache in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(fused_cache, torch_cache, atol=1e-6, rtol=1e-6)
    if rotated:
        assert not torch.allclose(q_fused, q.contiguous())
        torch.testing.assert_close(q_fused, apply_rope(q, *rope), atol=1e-6, rtol=1e-6)


def test_rope_and_store_round_into_a_caches_dtype():
    """A bfloat16 cache under float32 activations (cpu_tier.py's choice elsewhere): keys and values rounded once
    as they are stored."""
    T, H, KVH, D = 3, 2, 1, 16
    q, k, v = rows(T, H, D), rows(T, KVH, D, seed=1), rows(T, KVH, D, seed=2)
    rope = rope_tables([0, 1, 2], D)
    k_cache, v_cache = (
        torch.zeros(KVH, 8, D, dtype=torch.bfloat16),
        torch.zeros(KVH, 8, D, dtype=torch.bfloat16),
    )
    fused_rotate_and_store(q, k, v, k_cache, v_cache, torch.tensor([1, 2, 3]), rope)
    bf16 = dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(v_cache[:, 1:4].float(), v.transpose(0, 1).to(torch.bfloat16).float(), **bf16)
    expected = apply_rope(k, *rope).transpose(0, 1).to(torch.bfloat16)
    torch.testing.assert_close(k_cache[:, 1:4].float(), expected.float(), **bf16)
    assert not k_cache[:, 0].any() and not k_cache[:, 4:].any()
