"""GGUF's block types read from their raw bytes (model/gguf_blocks.py) and multiplied by the quantized GEMM
(model/csrc/quant_gemm.cpp) on every tier this CPU runs: random blocks (random quants and sub-scales, random
finite float16 scales), checked against gguf-py's own dequantization in float64."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from model import cpu_tier
from model.gguf_blocks import BLOCKS, from_gguf_blocks, gguf_weight
from model.kernels import load
from model.linear import Linear, PlainLinear
from model.quant import QuantizedLinear, QuantizedTensor
from tests.helpers.gguf_blocks import HALVES, int16_limit, random_blocks

NEW_TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q5_K", "Q5_1", "IQ4_NL", "IQ4_XS", "MXFP4"]


def reference(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """gguf-py's dequantized weights, float64 [N, K]."""
    return quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64)


def weight(type_name: str, N: int, K: int, seed: int = 0) -> tuple[QuantizedTensor, np.ndarray]:
    blocks = random_blocks(type_name, N, K, seed)
    return from_gguf_blocks(type_name, torch.from_numpy(blocks), (N, K)), reference(type_name, blocks)


def layer_for(qt, kernels, int8_activations: bool = False) -> Linear:
    segments = qt if isinstance(qt, list) else [qt]
    N, K = sum(s.shape[0] for s in segments), segments[0].shape[1]
    method = QuantizedLinear(kernels, PlainLinear(), int8_activations=int8_activations)
    layer = Linear(K, N, False, method, rows=True)
    layer.quantized = qt
    layer.method.prepare(layer)
    return layer


def error_bound(x: torch.Tensor, qt: QuantizedTensor, activations: str, kernels=None) -> torch.Tensor:
    """[M, N]: how far the kernel's float32 sums may stray from x W^T in float64. Each group's sum and the sum
    over groups round at most once per addition (K / group + 64 roundings of 2^-24 bound them), relative to what
    they add: |x| times |d| (128 + max |q|) and |m| per group (the bfloat16 kernel adds 128 d to a 4-bit q and
    takes it back with the minimum). int16 and int8 activations add their own rounding, half a step per input."""
    M, K = x.shape
    d, m = qt.scales()
    G = qt.group
    q_max = 2**qt.bits - 1 if qt.bits < 8 and qt.min is not None else 128
    per_group = d.double().abs() * (q_max + (128 if qt.min is not None else 0))
    if m is not None:
        per_group = per_group + m.double().abs()
    xg = x.double().abs().view(M, K // G, G).sum(-1)  # [M, groups]
    bound = xg @ per_group.T * (K / G + 64) * 2.0**-24
    if activations in ("int16", "int8"):
        largest = int16_limit(kernels, qt) if activations == "int16" else 127
        half_step = x.double().view(M, K // 32, 32).abs().amax(-1) / largest / 2  # [M, K / 32]
        w = qt.dequantize().double().abs().view(-1, K // 32, 32).sum(-1)  # [N, K / 32]
        bound = bound + half_step @ w.T
    return bound


@pytest.mark.timeout(60)
@pytest.mark.parametrize("type_name", [*NEW_TYPES, "Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_as_gguf_dequantizes_them(type_name):
    N, K = 17, 512
    qt, ref = weight(type_name, N, K, seed=3)
    assert qt.shape == (N, K) and qt.kind == type_name
    ours = qt.dequantize().double().numpy()
    if type_name == "Q4_0":  # gguf computes d (q - 8); we keep d q + (-8 d): the same up to one rounding
        np.testing.assert_allclose(ours, ref, rtol=0, atol=np.abs(ref).max() * 2**-22)
    else:
        assert np.array_equal(ours, ref)


@pytest.mark.timeout(60)
def test_resident_bits_per_weight(tier_kernels):
    """The packed form is close to the file's bits (model/quant.py's docstring states them); Q4_K's and Q5_K's
    are the file's (their 6-bit sub-scales and sub-minimums kept in 12 bits a group)."""
    expected = {"Q4_K": 4.5, "Q6_K": 6.625, "Q5_0": 6.0, "Q5_K": 5.5, "Q5_1": 6.0, "IQ4_NL": 4.5,
                "IQ4_XS": 4.3125, "Q4_0": 5.0, "Q4_1": 5.0, "Q8_0": 8.5, "MXFP4": 4.5}  # fmt: skip
    for type_name, bpw in expected.items():
        qt, _ = weight(type_name, 32, 512)
        # Q6_K's minimum is its scale: counted once; a levels table (16 bytes a layer) is no weight's
        packed = {id(t): t for k, t in qt.pack(tier_kernels).items() if t is not None and k != "levels"}
        bits = 8 * sum(t.numel() * t.element_size() for t in packed.values())
        assert bits / (32 * 512) == bpw, type_name


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "type_name,M,N,K",
    [
        (type_name, M, N, K)
        for type_name in NEW_TYPES
        for M, N, K in [(1, 600, 256), (17, 40, 512), (5, 17, 96)]
        if K % BLOCKS[type_name][0] == 0  # 96: 32-blocked types only
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_computes_x_times_the_file_weights(tier_kernels, type_name, M, N, K, dtype):
    """x W^T with W as gguf-py dequantizes the blocks, in float64: x as the kernel gets it (bfloat16, or
    float32), so the only error is the float32 sums' (and, on AVX2 tiers, int16 activations')."""
    qt, ref = weight(type_name, N, K, seed=M + N + K)
    layer = layer_for(qt, tier_kernels)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(K)).to(dtype)
    exact = x.double() @ torch.from_numpy(ref).T
    with torch.inference_mode():
        logits = layer.logits(x)
        out = layer(x)
    assert logits.dtype == torch.float32 and out.dtype == dtype and out.shape == (M, N)
    activations = getattr(tier_kernels, f"gemm_{str(dtype)[6:]}_as")
    bound = error_bound(x, qt, activations, tier_kernels)
    assert ((logits.double() - exact).abs() <= bound).all(), (logits.double() - exact).abs().max()
    assert torch.equal(out, logits.to(dtype))  # the same sums, rounded once
    ids = torch.tensor([0, N - 1, N // 2])
    assert torch.equal(layer.rows(ids, torch.float32).double(), torch.from_numpy(ref)[ids])


def rounded_to(x: torch.Tensor, largest: int) -> torch.Tensor:
    """x [M, K] as the int8 (largest 127: model/csrc/quant_gemm_i8.cpp) or int16 (32767: quant_gemm_i16.cpp)
    kernel rounds it, in float64: per row and 32, the step s = a / largest of the group's largest magnitude a,
    xq = x (largest / a) rounded to nearest, ties to even, in float32 (a group below 2^-100 scaled up by 2^100
    first)."""
    M, K = x.shape
    groups = x.float().view(M, K // 32, 32)
    a = groups.abs().amax(-1, keepdim=True)
    up = torch.where(a < 2.0**-100, 2.0**100, 1.0)
    # a tensor's quotient, IEEE's: torch takes largest / a as largest times a's reciprocal, an ulp off at times
    scale = torch.where(a > 0, torch.full_like(a, float(largest)) / (a * up), 0.0)
    xq = torch.round(groups * up * scale)
    assert xq.abs().max() <= largest
    return (xq.double() * (a / largest).double()).view(M, K)


def rows_of_every_scale(K: int) -> torch.Tensor:
    """11 rows of K: tiny groups (down to subnormals), a zero row, large values, one tiny value among ordinary ones."""
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(6))
    x[1] *= 1e-33  # groups below 2^-100 (whose steps stay normal floats)
    x[2, :64] *= 1e-39  # two groups of subnormals beside normal ones
    x[3] = 0.0
    x[4] *= 3e4
    x[5, 100] = 1e-30  # one tiny value in a group of ordinary ones: rounded to 0
    return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", [t.name for t in cpu_tier.runnable() if t.name in ("avx512bf16", "avx2")])
@pytest.mark.parametrize("type_name", [*NEW_TYPES, "Q4_0", "Q4_1", "Q8_0"])
def test_int8_activations_times_the_file_weights(tier, type_name):
    """With --gemm-activations int8 the avx512bf16 tier rounds bfloat16 activations to int8 per group of 32, the
    avx2 tier float32 ones too (the signed bytes of IQ4's levels and Q8_0 giving x their sign there): the
    result is x so rounded times the file's exact weights, up to float32's sums alone (a bound thousands of times
    tighter than the rounding's own). Rows of every scale: tiny groups (down to bfloat16's subnormals), a zero
    row, large values; a group holding an infinity or a NaN makes its row NaN and leaves the others as they are."""
    kernels = load(tier)
    N, K = 40, 512
    qt, ref = weight(type_name, N, K, seed=5)
    layer = layer_for(qt, kernels, int8_activations=True)
    x = rows_of_every_scale(K).to(getattr(torch, kernels.gemm_int8[-1]))  # float32 where the tier takes it
    xr = rounded_to(x, 127)
    exact = xr @ torch.from_numpy(ref).T
    with torch.inference_mode():
        logits = layer.logits(x)
    bound = error_bound(xr, qt, "float32 sums")
    assert ((logits.double() - exact).abs() <= bound).all(), (logits.double() - exact).abs().max()
    assert (logits[1] != 0).any() and (logits[2] != 0).any() and (logits[3] == 0).all()
    poisoned = x.clone()
    poisoned[7, 40] = float("inf")
    poisoned[8, 300] = float("nan")
    with torch.inference_mode():
        out = layer.logits(poisoned)
    assert out[7].isnan().all() and out[8].isnan().all()
    assert torch.equal(out[[0, 1, 2, 3, 4, 5, 6, 9, 10]], logits[[0, 1, 2, 3, 4, 5, 6, 9, 10]])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", [t.name for t in cpu_tier.runnable() if t.name in ("avx512bf16", "avx2")])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_int8_activations_at_the_largest_products(tier, type_name):
    """Every q at its largest (all the quant bytes 0xFF) times groups of equal x, whose xq are all 127 or -127:
    the AVX2 kernel sums product pairs in int16, a 4-bit group's 8 chunks (8 x 2 x 15 x 127 = 30,480), 5 bits' 4
    chunks (31,496), 6 bits' 2 (32,004), all below 2^15, so this is where an int16 sum too many would wrap."""
    kernels = load(tier)
    N, K = 40, 512
    blocks = random_blocks(type_name, N, K, seed=3).reshape(N, K // BLOCKS[type_name][0], -1)
    scales = list(HALVES[type_name])
    quants = np.ones(blocks.shape[-1], dtype=bool)
    for at in scales:
        quants[at : at + 2] = False
    blocks[..., quants] = 0xFF
    blocks = blocks.reshape(N, -1)
    qt = from_gguf_blocks(type_name, torch.from_numpy(blocks), (N, K))
    ref = reference(type_name, blocks)
    layer = layer_for(qt, kernels, int8_activations=True)
    x = torch.ones(4, K)
    x[1] = -1.0
    x[2, ::2] = -1.0  # signs alternating within a pair
    x[3] = 3.0
    x = x.to(getattr(torch, kernels.gemm_int8[-1]))
    exact = rounded_to(x, 127) @ torch.from_numpy(ref).T
    with torch.inference_mode():
        logits = layer.logits(x)
    bound = error_bound(rounded_to(x, 127), qt, "float32 sums")
    assert ((logits.double() - exact).abs() <= bound).all(), (logits.double() - exact).abs().max()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tier", [t.name for t in cpu_tier.runnable() if t.name != "generic"])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "IQ4_XS", "Q4_1", "Q8_0"])
def test_int16_activations_at_every_scale(tier, type_name):
    """Where float32 activations are rounded to int16 per group of 32 (AVX2 tiers; AMX's tiles take the same
    integers, to fewer levels for 4- and 5-bit weights with a minimum: kernels.gemm_int16_narrow), the result is x so rounded times the file's exact weights at every scale: groups too small for
    32767 / a in float32 (below ~2^-113) are scaled up first, as the int8 kernel's are."""
    kernels = load(tier)
    assert kernels.gemm_float32_as == "int16"
    qt, ref = weight(type_name, 40, 512, seed=9)
    layer = layer_for(qt, kernels)
    x = rows_of_every_scale(512)
    x[6] *= 1e-36  # a whole row of groups below 2^-113
    xr = rounded_to(x, int16_limit(kernels, qt))
    exact = xr @ torch.from_numpy(ref).T
    with torch.inference_mode():
        logits = layer.logits(x)
    bound = error_bound(xr, qt, "float32 sums")
    assert ((logits.double() - exact).abs() <= bound).all(), (logits.double() - exact).abs().max()
    assert (logits[1] != 0).all() and (logits[6] != 0).all() and (logits[3] == 0).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q5_K", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "int8", [False, True]
)  # --gemm-activations int8 (the tier's own where it has no kernel)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(tier_kernels, type_name, dtype, int8):
    """Batches of 1..40 rows take every kernel path (packed tiles, blocks of rows, tiles unpacked once): each
    row's bits are those it gets alone."""
    qt, _ = weight(type_name, 40, 512, seed=7)
    layer = layer_for(qt, tier_kernels, int8_activations=int8)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(8)).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer.logits(x[i : i + 1]) for i in range(40)])
        for n in range(1, 41):
            assert torch.equal(layer.logits(x[:n]), alone[:n]), n
        assert torch.equal(layer.logits(x[13:40]), alone[13:40])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("int8", [False, True])
def test_a_fused_layer_of_mixed_formats_keeps_each_part_as_it_is(tier_kernels, dtype, int8):
    """q and k in Q4_K, v in Q6_K (a Q4_K_M file's "more bits" layers): one segment per run of a format, each
    writing its own columns, with the same bits as each part multiplied alone."""
    q, _ = weight("Q4_K", 48, 256, seed=1)
    k, _ = weight("Q4_K", 16, 256, seed=2)
    v, _ = weight("Q6_K", 24, 256, seed=3)
    segments = QuantizedTensor.segments([q, k, v])
    assert [s.kind for s in segments] == ["Q4_K", "Q6_K"] and segments[0].shape == (64, 256)
    fused = layer_for(segments, tier_kernels, int8)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.inference_mode():
        apart = torch.cat([layer_for(p, tier_kernels, int8).logits(x) for p in (q, k, v)], dim=1)
        assert torch.equal(fused.logits(x), apart)
        assert torch.equal(fused(x), apart.to(dtype))
        ids = torch.tensor([0, 63, 64, 87, 50])
        want = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])[ids]
        assert torch.equal(fused.rows(ids, torch.float32), want)


@pytest.mark.timeout(120)
def test_level_tables_are_a_format_of_their_own(tier_kernels):
    """IQ4_NL's and MXFP4's q both index 16 levels, different ones: fused by rows they stay two segments, each
    multiplied by its own levels."""
    iq4, iq4_ref = weight("IQ4_NL", 24, 256, seed=1)
    mxfp4, mxfp4_ref = weight("MXFP4", 40, 256, seed=2)
    segments = QuantizedTensor.segments([iq4, mxfp4])
    assert [s.kind for s in segments] == ["IQ4_NL", "MXFP4"]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ torch.from_numpy(np.concatenate([iq4_ref, mxfp4_ref])).T
    with torch.inference_mode():
        fused = layer_for(segments, tier_kernels).logits(x)
    bound = torch.cat(
        [error_bound(x, q, tier_kernels.gemm_float32_as, tier_kernels) for q in (iq4, mxfp4)], dim=1
    )
    assert ((fused.double() - exact).abs() <= bound).all()


@pytest.mark.timeout(60)
def test_mxfp4_scales_no_float16_holds_are_dequantized_exactly():
    """An E8M0 scale outside float16's range (2^-25 and below, 2^16 and above: no real checkpoint's) cannot be a
    group's float16 scale: that weight is dequantized instead, exactly, rather than rounded."""
    blocks = random_blocks("MXFP4", 4, 64, seed=9)
    blocks[0, 0] = 127 - 30  # 2^-30
    with pytest.raises(ValueError, match="not all float16"):
        from_gguf_blocks("MXFP4", torch.from_numpy(blocks), (4, 64))
    dense = gguf_weight("MXFP4", torch.from_numpy(blocks), (4, 64))
    assert isinstance(dense, torch.Tensor) and torch.equal(
        dense.double(), torch.from_numpy(reference("MXFP4", blocks))
    )


@pytest.mark.timeout(60)
def test_q6_k_scales_whose_minimum_is_no_float16_are_dequantized_exactly():
    """The kernels take a Q6_K group's minimum as -32 d (model/csrc/quant_gemm.h): a d above 2047 (no real
    checkpoint's), whose -32 d overflows float16, cannot be kept so: that weight is dequantized instead, exactly.
    One just inside stays quantized and multiplies as gguf-py dequantizes it."""
    blocks = random_blocks("Q6_K", 4, 256, seed=11)
    blocks[0, 208:210] = np.array([2048.0], dtype=np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="no float16"):
        from_gguf_blocks("Q6_K", torch.from_numpy(blocks), (4, 256))
    dense = gguf_weight("Q6_K", torch.from_numpy(blocks), (4, 256))
    assert isinstance(dense, torch.Tensor) and torch.equal(
        dense.double(), torch.from_numpy(reference("Q6_K", blocks))
    )
    blocks[0, 208:210] = np.array([-2047.0], dtype=np.float16).view(np.uint8)
    qt = from_gguf_blocks("Q6_K", torch.from_numpy(blocks), (4, 256))
    assert torch.equal(qt.dequantize().double(), torch.from_numpy(reference("Q6_K", blocks)))


@pytest.mark.timeout(60)
def test_wrong_sizes_and_types_are_refused():
    with pytest.raises(ValueError, match="not kept quantized"):
        from_gguf_blocks("Q3_K", torch.zeros(1, 110, dtype=torch.uint8), (1, 256))
    with pytest.raises(ValueError, match="do not make"):
        from_gguf_blocks("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), (2, 512))
