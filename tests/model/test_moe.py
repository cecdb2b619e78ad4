"""The sparse MoE FFN as one C++ call (model/csrc/moe.cpp) against model/moe.py's PyTorch loop, on every CPU tier:
the same experts chosen and the same sums, and each token's output independent of its batch; Gemma 4's too (GeGLU
experts behind a router that reads the residual stream, RMS-normed and scaled)."""

import dataclasses

import pytest
import torch

from model.kernels import cpu_kernels
from model.linear import PlainLinear
from model.loader import load_model
from model.moe import DenseAndMoE, MoE
from model.quant import QuantizedLinear
from model.transformer import Ops
from tests.helpers.tiny_models import tiny_family
from tests.model.test_gemma4 import tiny_moe_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels could not be built here")


def sparse_ffns(path, kernels, bits: int, dtype, fused: bool = True) -> list[MoE]:
    ops = Ops.with_kernels(QuantizedLinear(kernels, PlainLinear(), bits), kernels)
    if not fused:
        ops = dataclasses.replace(ops, moe=None)
    model, _ = load_model(path, dtype, "cpu", ops)
    mlps = [layer.mlp.moe if isinstance(layer.mlp, DenseAndMoE) else layer.mlp for layer in model.layers]
    return [mlp for mlp in mlps if isinstance(mlp, MoE)]


def sparse_model(factory, tmp_path, arch: str):
    """The tiny model of a MoE family; gemma4: 26B-A4B's FFNs in small (tests/model/test_gemma4.py)."""
    if arch == "gemma4":
        tiny_moe_model(tmp_path)
        return tmp_path
    return tiny_family(factory, arch)


def hidden_states(n: int, size: int, dtype) -> torch.Tensor:
    return torch.randn(n, size, generator=torch.Generator().manual_seed(0)).to(dtype)


# qwen2moe: a shared expert and 3 of 8 experts, not renormalized; mixtral: 2 of 8, renormalized; gemma4: 2 of 8,
# renormalized and scaled per expert, GeGLU, the router reading a stream of its own
@pytest.mark.parametrize("arch", ["qwen2moe", "mixtral", "gemma4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_ffn_computes_the_python_loops_sums(
    tiny_model_factory, tmp_path, tier_kernels, arch, dtype
):
    path = sparse_model(tiny_model_factory, tmp_path, arch)
    fused = sparse_ffns(path, tier_kernels, 8, dtype)
    looped = sparse_ffns(path, tier_kernels, 8, dtype, fused=False)
    assert fused and all(f.fused is not None for f in fused) and all(f.fused is None for f in looped)
    x = hidden_states(40, fused[0].router.weight.shape[1], dtype)
    stream = (hidden_states(41, x.shape[1], dtype)[1:],) if arch == "gemma4" else ()  # the router's input
    with torch.inference_mode():
        for a, b in zip(fused, looped, strict=True):
            ours, reference = a(x, *stream).float(), b(x, *stream).float()
            scale = reference.abs().max().item()
            assert (ours - reference).abs().max().item() <= scale * (1e-5 if dtype == torch.float32 else 1e-2)
            assert ours.abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_its_batch(
    tiny_model_factory, tmp_path, tier_kernels, arch, dtype
):
    ffn = sparse_ffns(sparse_model(tiny_model_factory, tmp_path, arch), tier_kernels, 4, dtype)[0]
    x = hidden_states(33, ffn.router.weight.shape[1], dtype)
    stream = hidden_states(34, x.shape[1], dtype)[1:] if arch == "gemma4" else None
    part = (lambda rows: (x[rows], stream[rows])) if arch == "gemma4" else (lambda rows: (x[rows],))
    with torch.inference_mode():
        together = ffn(*part(slice(None)))
        for i in range(len(x)):
            assert torch.equal(ffn(*part(slice(i, i + 1))), together[i : i + 1]), i
        assert torch.equal(ffn(*part(slice(5, 21))), together[5:21])


def test_experts_left_dense_run_the_python_loop(tiny_model_factory):
    """Dense experts (no quantization at load): the C++ FFN runs quantized experts only."""
    kernels = cpu_kernels()
    model, _ = load_model(tiny_family(tiny_model_factory, "mixtral"), torch.float32, "cpu",
                          Ops.with_kernels(PlainLinear(), kernels))  # fmt: skip
    assert all(layer.mlp.fused is None for layer in model.layers) and model.layer_stack is None


def test_a_load_hands_the_heaps_free_pages_back_as_it_goes(tiny_model_factory, monkeypatch):
    """An MoE's thousands of small expert weights leave freed copies in the C heap while loading: the loader
    hands them back every TRIM_EVERY bytes read, not only once at the end (the load's peak)."""
    import model.loader as loader

    calls = []
    monkeypatch.setattr(loader, "return_freed_memory", lambda: calls.append(1))
    path = tiny_family(tiny_model_factory, "mixtral")
    ops = Ops.with_kernels(PlainLinear(), cpu_kernels())
    load_model(path, torch.float32, "cpu", ops)
    assert len(calls) == 1  # a tiny model reads far less than TRIM_EVERY: once, at the end
    calls.clear()
    monkeypatch.setattr(loader, "TRIM_EVERY", 4096)
    load_model(path, torch.float32, "cpu", ops)
    assert len(calls) > 10
