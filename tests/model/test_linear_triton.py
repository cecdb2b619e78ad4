"""model/linear_triton.py, the GPU's GEMM on quantized weights, run on the CPU by Triton's interpreter: every GGUF
block format (random blocks) and the formats made at load, against gguf-py's dequantized weights, at a decode's
rows and a prefill's, fused layers of two formats, biases, embedding rows and float32 logits; and, where a GPU is,
every format compiled on it in bfloat16."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from model.gguf_blocks import BLOCKS, from_gguf_blocks
from model.linear import Linear, PlainLinear
from model.quant import QuantizedTensor
from tests.helpers.gguf_blocks import random_blocks

# the tests below but the last run the kernel under Triton's interpreter (skipped where a GPU compiles it)
interpreted = pytest.mark.usefixtures("triton_here")


def weight(type_name: str, N: int, K: int, seed: int = 0) -> tuple[QuantizedTensor, torch.Tensor]:
    """A random weight of the format, and gguf-py's dequantization of its blocks (float64)."""
    blocks = random_blocks(type_name, N, K, seed)
    want = quants.dequantize(blocks, GGMLQuantizationType[type_name]).astype(np.float64)
    return from_gguf_blocks(type_name, torch.from_numpy(blocks), (N, K)), torch.from_numpy(want)


def layer_for(qt, bias: torch.Tensor | None = None, bits: int | None = None, dense=None) -> Linear:
    from model.linear_triton import TritonQuantLinear

    segments = qt if isinstance(qt, list) else [qt]
    N, K = sum(s.shape[0] for s in segments), segments[0].shape[1]
    method = TritonQuantLinear(torch.device("cpu"), torch.float32, PlainLinear(), bits)
    layer = Linear(K, N, bias is not None, method, rows=True)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    if dense is not None:
        layer.weight = torch.nn.Parameter(dense, requires_grad=False)
    layer.quantized = qt
    layer.method.prepare(layer)
    assert (
        layer.segments and layer.weight.is_meta
    )  # on the kernel: not served dequantized after a failed check
    return layer


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@interpreted
@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_every_gguf_format_multiplies_as_its_dequantized_weights(type_name):
    # N not a multiple of a tile (32, 64), K two super-blocks; 3 rows (a decode step's tile) and 37 (a prefill's)
    qt, want_w = weight(type_name, 40, 512)
    layer = layer_for(qt)
    g = torch.Generator().manual_seed(1)
    for rows in (3, 37):
        x = torch.randn(rows, 512, generator=g)
        y = layer(x)
        assert y.shape == (rows, 40) and y.dtype == torch.float32
        assert relative_error(y, x.double() @ want_w.T) < 1e-5, type_name


@interpreted
@pytest.mark.parametrize("bits", [4, 8])
def test_weights_quantized_at_load_multiply_as_dequantized(bits):
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(24, 96, generator=g)  # K = 96: a step of one group of 32
    layer = Linear(96, 24, False, None)
    from model.linear_triton import TritonQuantLinear

    layer.method = TritonQuantLinear(torch.device("cpu"), torch.float32, PlainLinear(), bits)
    layer.weight = torch.nn.Parameter(dense, requires_grad=False)
    layer.method.prepare(layer)
    assert layer.bits == bits and layer.weight.is_meta
    want_w = QuantizedTensor.quantize(dense, bits).dequantize().double()
    x = torch.randn(5, 96, generator=g)
    assert relative_error(layer(x), x.double() @ want_w.T) < 1e-5
    # and quantization is no copy of the dense weights: 4 bits round far more than 8
    assert relative_error(layer(x), x.double() @ dense.double().T) > (1e-3 if bits == 4 else 1e-5)


@interpreted
def test_a_fused_layer_of_two_formats_with_a_bias():
    # a Q4_K_M file's attn_q/attn_k (Q4_K) and attn_v (Q6_K) as one q/k/v layer, each run in its own format
    (qk, want_qk), (v, want_v) = weight("Q4_K", 48, 256, 3), weight("Q6_K", 16, 256, 4)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(5))
    layer = layer_for([qk, v], bias)
    assert layer.kinds == ["Q4_K", "Q6_K"]
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    want = x.double() @ torch.cat([want_qk, want_v]).T + bias.double()
    assert relative_error(layer(x), want) < 1e-5


@interpreted
@pytest.mark.parametrize("type_name", ["Q4_K", "IQ4_XS", "Q8_0", "Q6_K"])
def test_embedding_rows_and_logits(type_name):
    qt, want_w = weight(type_name, 32, 256, 7)
    layer = layer_for(qt)
    ids = torch.tensor([5, 0, 31, 5])
    assert torch.equal(layer.rows(ids, torch.float32), want_w[ids].float())
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8))
    logits = layer.logits(x)
    assert logits.dtype == torch.float32 and relative_error(logits, x.double() @ want_w.T) < 1e-5


@interpreted
def test_a_bfloat16_step_rounds_like_the_dequantized_weights():
    # the model's dtype in and out: within bfloat16's rounding of the float32 product
    qt, want_w = weight("Q4_K", 64, 512, 9)
    layer = layer_for(qt)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(10)).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    want = F.linear(x.float(), want_w.float().bfloat16().float())
    assert relative_error(y.float(), want.double()) < 2e-2


@interpreted
def test_the_start_check_measures_the_kernel():
    from model.linear_triton import error_against_dequantized

    qt, _ = weight("Q4_K", 40, 256, 11)
    assert error_against_dequantized(qt, torch.device("cpu"), torch.float32) < 1e-5


@interpreted
def test_a_format_the_kernel_gets_wrong_is_served_dequantized(monkeypatch, caplog):
    import model.linear_triton
    from model.linear_triton import TritonQuantLinear

    qt, want_w = weight("Q4_K", 32, 256, 12)
    monkeypatch.setattr(model.linear_triton, "error_against_dequantized", lambda *a: 0.5)
    layer = Linear(256, 32, False, TritonQuantLinear(torch.device("cpu"), torch.float32, PlainLinear()))
    layer.quantized = qt
    with caplog.at_level("WARNING"):
        layer.method.prepare(layer)
    assert (
        "Q4_K weights served dequantized to float32 (kvserve's Triton GEMM is off by 0.5 here)" in caplog.text
    )
    assert layer.bits is None and not layer.weight.is_meta and torch.equal(layer.weight, want_w.float())
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(13))
    assert relative_error(layer(x), x.double() @ want_w.T) < 1e-5


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_on_the_gpu_every_format_multiplies_as_its_dequantized_bfloat16_weights(type_name):
    """The compiled kernel on the device, bfloat16 in and out, at a decode's rows (K split), a tile's edge and a
    prefill's, against F.linear in float32 on the same weights rounded to bfloat16 (what a dense GPU layer holds)."""
    from model.linear_triton import TritonQuantLinear

    cuda = torch.device("cuda")
    qt, _ = weight(type_name, 1000, 2048, 14)
    layer = Linear(2048, 1000, False, TritonQuantLinear(cuda, torch.bfloat16, PlainLinear()))
    layer.quantized = qt
    layer.method.prepare(layer)
    assert layer.segments and layer.weight.is_meta
    w = qt.dequantize().to(cuda, torch.bfloat16).float()
    g = torch.Generator(device=cuda).manual_seed(15)
    for rows in (1, 7, 16, 17, 300):
        x = torch.randn(rows, 2048, generator=g, device=cuda).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 1000)
        want = x.float() @ w.T
        assert ((y.float() - want).abs().max() / want.abs().max()).item() < 1e-2, (type_name, rows)
