"""Quantized weights (model/quant.py) and the C++ GEMM on them (model/csrc/quant_gemm.cpp); the GGUF blocks
come as raw block rows, as the loader reads them (from a GGUF in place, or a converted folder)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from model import cpu_tier
from model.gguf_blocks import from_gguf_blocks
from model.gguf_blocks import gguf_weight as read_gguf_weight
from model.kernels import cpu_kernels, load
from model.linear import Linear, PlainLinear
from model.quant import QuantizedLinear, QuantizedTensor
from tests.helpers.gguf_blocks import int16_limit, random_blocks

GGUF_TYPES = {
    "Q4_0": GGMLQuantizationType.Q4_0,
    "Q4_1": GGMLQuantizationType.Q4_1,
    "Q8_0": GGMLQuantizationType.Q8_0,
}


def gguf_weight(kind: str, N: int, K: int, seed: int = 0) -> tuple[QuantizedTensor, np.ndarray]:
    """A random weight quantized by the gguf package: ours, and gguf's own dequantized values."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    t = GGUF_TYPES[kind]
    raw = quants.quantize(w, t)  # uint8 [N, bytes per row]
    return from_gguf_blocks(kind, torch.from_numpy(raw), (N, K)), quants.dequantize(raw, t)


def layer_for(qt: QuantizedTensor, bias: torch.Tensor | None = None, kernels=None) -> Linear:
    N, K = qt.shape
    layer = Linear(
        K, N, bias is not None, QuantizedLinear(kernels or cpu_kernels(), PlainLinear()), rows=True
    )
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer.quantized = qt
    layer.method.prepare(layer)
    return layer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_read_as_gguf_dequantizes_them(kind):
    qt, reference = gguf_weight(kind, 24, 96)
    ours = qt.dequantize().numpy()
    if kind == "Q4_0":  # gguf computes d (q - 8); we keep d q + (-8 d): the same up to one rounding
        np.testing.assert_allclose(ours, reference, rtol=0, atol=np.abs(reference).max() * 2**-22)
    else:
        assert np.array_equal(ours, reference)


def rounding_bound(x: torch.Tensor, w: torch.Tensor, largest: int) -> torch.Tensor:
    """[M, N]: how far x W^T may move when each group of 32 of a row of x is rounded to integers of at most
    `largest` in magnitude against the group's largest magnitude (half a step, max|x| / largest / 2, per input)."""
    M, K = x.shape
    groups = x.double().view(M, K // 32, 32)
    half_step = groups.abs().amax(-1) / largest / 2  # [M, G]
    return half_step @ w.double().abs().view(-1, K // 32, 32).sum(-1).T  # [M, N]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("N,K", [(48, 64), (40, 96), (7, 32), (100, 576)])  # N not a multiple of 16 too
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # each tier's activations, on every tier
def test_gemm_computes_x_times_the_exact_weights(tier_kernels, kind, N, K, dtype):
    """The weights are the file's exact values on every tier; the activations are what the tier multiplies
    natively (kernels.gemm_*_as): bfloat16 and float32 as they are, or int16 per group of 32 with AVX2, or
    int8 (bfloat16 ones with AVX512-VNNI)."""
    qt, _ = gguf_weight(kind, N, K, seed=N + K)
    layer = layer_for(qt, kernels=tier_kernels)
    x = torch.randn(13, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = x.double() @ qt.dequantize().double().T  # [13, N]
    with torch.inference_mode():
        logits = layer.logits(x)
        out = layer(x)
    assert logits.dtype == torch.float32 and out.dtype == dtype and out.shape == (13, N)
    scale = exact.abs().max()
    activations = getattr(tier_kernels, f"gemm_{str(dtype)[6:]}_as")
    allowed = 1e-5 * scale  # float32 sums
    # integer activations (kernels.gemm_*_as): their largest magnitude
    largest = {"int16": int16_limit(tier_kernels, qt), "int8": 127}.get(activations)
    if largest:
        allowed = allowed + rounding_bound(x, qt.dequantize(), largest)
    assert ((logits.double() - exact).abs() <= allowed).all()
    assert torch.equal(out, logits.to(dtype))  # the same sums, rounded once


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    "amx" not in [t.name for t in cpu_tier.runnable()], reason="AMX: Xeons that have its tiles"
)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_amx_tiles_give_the_vector_kernels_bits(kind):
    """On the amx tier a GEMM of a few rows runs on vectors and one of many on AMX's int8 tiles, with the same
    integer sums: every row count gives each row the bits it gets alone (on vectors), and where the tier keeps
    int16's 32767 levels (Q6_K, Q8_0: two tile products a group), the avx512 tier's bits. The K-quants' blocks
    are random bytes: every 6-bit sub-scale and sub-minimum."""
    K = 512
    if kind in GGUF_TYPES:
        qt, _ = gguf_weight(kind, 100, K)
    else:
        qt = from_gguf_blocks(kind, torch.from_numpy(random_blocks(kind, 100, K)), (100, K))
    kernels = load("amx")
    amx, vectors = layer_for(qt, kernels=kernels), layer_for(qt, kernels=load("avx512"))
    narrow = int16_limit(kernels, qt) < 32767
    assert narrow == (kind in ("Q4_1", "Q4_K", "Q5_K"))
    for rows in (1, 4, 5, 16, 17, 40):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            together = amx.logits(x)
            assert torch.equal(together, torch.cat([amx.logits(row) for row in x.split(1)])), rows
            if not narrow:
                assert torch.equal(together, vectors.logits(x)), rows


def bfloat16_weights(qt: QuantizedTensor) -> torch.Tensor:
    """[N, K] float64: each weight d q + m rounded once to float32 (an FMA), then to bfloat16."""
    N, K = qt.shape
    d, m = qt.scales()
    q = qt.q.long()
    if qt.level_table:
        q = torch.tensor(qt.level_table)[q]
    w = q.view(N, K // qt.group, qt.group).double() * d.double()[..., None]
    if m is not None:
        w = w + m.double()[..., None]
    return w.view(N, K).float().bfloat16().double()


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    "amx" not in [t.name for t in cpu_tier.runnable()], reason="AMX: Xeons that have its tiles"
)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_dequantized_gemm_is_x_times_the_bfloat16_weights(kind, dtype):
    """A prompt's rows on the amx tier (quant_gemm_dequantized): x and the weights rounded to bfloat16, the
    products summed in float32, the bias added; each row's bits the same at any row count (blocks of 32 rows on
    the tiles, the last one padded)."""
    N, K = 100, 512  # N not a multiple of the tiles' 16 outputs
    if kind in GGUF_TYPES:
        qt, _ = gguf_weight(kind, N, K)
    else:
        qt = from_gguf_blocks(kind, torch.from_numpy(random_blocks(kind, N, K)), (N, K))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    kernels = load("amx")
    layer = layer_for(qt, bias, kernels=kernels)
    assert kernels.gemm_dequantized
    w = bfloat16_weights(qt)
    for rows in (1, 17, 40, 100):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
        xb = x.bfloat16().double()
        with torch.inference_mode():
            out = kernels.quant_gemm_dequantized(x, layer.gemm)
            alone = torch.cat([kernels.quant_gemm_dequantized(row, layer.gemm) for row in x.split(1)])
        assert out.dtype == dtype and out.shape == (rows, N)
        assert torch.equal(out, alone), rows
        sums = xb @ w.T
        allowed = 1e-5 * (xb.abs() @ w.abs().T)  # float32 sums of exact products
        if dtype == torch.bfloat16:  # and the output rounded once
            allowed = allowed + (sums + bias.double()).abs() * 2**-8
        assert ((out.double() - bias.double() - sums).abs() <= allowed + 1e-6).all(), rows


@pytest.mark.timeout(60)
def test_the_dequantized_gemm_is_refused_without_amx(tier_kernels):
    qt, _ = gguf_weight("Q4_1", 32, 64)
    layer = layer_for(qt, kernels=tier_kernels)
    if tier_kernels.gemm_dequantized:
        return  # the amx tier: the test above
    with pytest.raises(RuntimeError, match="amx tier only"):
        tier_kernels.quant_gemm_dequantized(torch.randn(4, 64), layer.gemm)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bias_is_added_in_float32(tier_kernels, dtype):
    qt, _ = gguf_weight("Q4_1", 32, 64)
    bias = torch.randn(32)
    layer = layer_for(qt, bias, kernels=tier_kernels)
    x = torch.randn(5, 64).to(dtype)
    with torch.inference_mode():
        without = layer_for(qt, kernels=tier_kernels).logits(x)
        assert torch.equal(layer.logits(x), without + bias)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_in_any_batch(tier_kernels, kind, dtype):
    """Every kernel path (one row over several tiles, blocks of rows from the packed weights, one or several
    (5 to 8 rows with AVX2 alone), blocks of rows over a tile unpacked once) gives a row the same bits."""
    qt, _ = gguf_weight(kind, 100, 192)
    layer = layer_for(qt, kernels=tier_kernels)
    x = torch.randn(70, 192, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[3, 5] = 1e-30  # tiny activations, the same in every path too
    with torch.inference_mode():
        full = layer(x)
        logits = layer.logits(x)
        for rows in (slice(0, 1), slice(5, 6), slice(0, 2), slice(0, 3), slice(3, 12), slice(8, 25),
                     slice(36, 37), slice(1, 70), slice(3, 4), slice(10, 15), slice(20, 26), slice(30, 37),
                     slice(40, 48)):  # fmt: skip
            assert torch.equal(layer(x[rows]), full[rows]), rows
            assert torch.equal(layer.logits(x[rows]), logits[rows]), rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_rows_are_the_exact_weights(kind):
    qt, _ = gguf_weight(kind, 50, 64)
    layer = layer_for(qt)
    ids = torch.tensor([0, 49, 17, 17, 3])
    assert torch.equal(layer.rows(ids, torch.float32), qt.dequantize()[ids])
    assert layer.weight.is_meta  # only the packed form is held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_at_load_rounds_each_weight_to_its_group_grid(bits):
    w = torch.randn(20, 64) * torch.linspace(0.01, 2, 64)  # groups of very different ranges
    qt = QuantizedTensor.quantize(w, bits)
    err = (qt.dequantize() - w).abs().view(20, 2, 32)
    assert (err <= qt.scale.float()[..., None] * 0.51 + 1e-4).all()  # half a step (scales are float16)
    if bits == 4:
        assert qt.q.max() <= 15 and torch.equal(qt.min, w.view(20, 2, 32).amin(-1).half())
    else:
        assert qt.q.abs().max() <= 127


@pytest.mark.timeout(60)
def test_fused_and_reordered_rows_stay_exact():
    a, _ = gguf_weight("Q4_1", 16, 64, seed=1)
    b, _ = gguf_weight("Q4_1", 8, 64, seed=2)
    fused = QuantizedTensor.cat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    order = torch.randperm(24)
    assert torch.equal(fused.select_rows(order).dequantize(), fused.dequantize()[order])


@pytest.mark.timeout(30)
def test_a_type_no_kernel_keeps_is_dequantized_by_gguf():
    """Q3_K (no kernel of kvserve's) comes back as gguf's float32 values; a kept type as a QuantizedTensor."""
    raw = np.random.default_rng(0).integers(0, 256, (4, 110), dtype=np.uint8)  # one Q3_K block a row
    raw[:, 108:110] = np.array([0.01], dtype=np.float16).view(np.uint8)  # its d, last: finite
    dense = read_gguf_weight("Q3_K", torch.from_numpy(raw), (4, 256))
    assert dense.dtype == torch.float32 and dense.shape == (4, 256)
    assert np.array_equal(dense.numpy(), quants.dequantize(raw, GGMLQuantizationType.Q3_K))
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q8 = quants.quantize(w, GGMLQuantizationType.Q8_0)
    assert isinstance(read_gguf_weight("Q8_0", torch.from_numpy(q8), (4, 64)), QuantizedTensor)
    with pytest.raises(ValueError, match="Q8_0 blocks of"):
        from_gguf_blocks("Q8_0", torch.from_numpy(q8[:, :34]), (4, 64))
