"""The C++ CPU kernels' build and RMSNorm (the attention kernel is tested in test_attention.py)."""

import pytest
import torch
import torch.nn.functional as F

from model.kernels import cpu_kernels


@pytest.mark.timeout(120)
def test_cpu_kernels_build_here(tier_kernels):
    """CI machines have a C++ compiler: the kernels of every tier this CPU runs must have been built by the
    install, not silently fall back."""
    kernels = tier_kernels
    assert kernels is not None
    for name in ("paged_attention", "rms_norm", "silu_mul", "quant_gemm", "quant_rows", "QuantGemm"):
        assert hasattr(kernels, name), name


def test_two_source_trees_sharing_a_venv_keep_their_own_builds(tmp_path, monkeypatch):
    """Two checkouts (git worktrees) installed into one venv: each compiles in a work folder of its own and keeps
    its build when the other builds, while a tree's own older build is replaced (its compiles stubbed: the
    folders are what is tested)."""
    from model import kernels
    from model.cpu_tier import TIERS

    tier = next(t for t in TIERS if t.name == "generic")

    def fake_compile(tier, work):
        (work / (kernels.module_name(tier) + ".so")).write_bytes(b"a module")
        compiled.append(work)

    compiled = []
    monkeypatch.setattr(kernels, "_compile", fake_compile)
    monkeypatch.setenv("KVSERVE_KERNELS_DIR", str(tmp_path / "venv"))
    trees = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "k.cpp").write_text(f"// tree {name}")
        monkeypatch.setattr(kernels, "SOURCES", tmp_path / name)
        trees[name] = kernels.build(tier)
    assert trees["a"] != trees["b"] and all(
        (t / "kvserve_cpu_kernels_generic.so").is_file() for t in trees.values()
    )
    assert len(set(compiled)) == 2  # a work folder each
    (tmp_path / "b" / "k.cpp").write_text("// tree b, edited")
    newer = kernels.build(tier)
    assert not trees["b"].exists() and newer.is_dir() and trees["a"].is_dir()


def test_every_source_compiles_in_exactly_one_unit(tmp_path):
    """The unity build's units hold every .cpp of model/csrc once (a source left out would fail only when its
    module loads, one in two units twice over at link), and a unit file is rewritten only when its text changes,
    so that ninja recompiles only what an edit touched."""
    from model import kernels

    listed = [source for unit in kernels.UNITS for source in unit]
    assert sorted(listed) == sorted(p.name for p in kernels.SOURCES.glob("*.cpp"))
    paths = kernels.write_units(tmp_path)
    assert len(paths) == len(kernels.UNITS)
    includes = paths[0].read_text().splitlines()
    assert includes == [f'#include "{(kernels.SOURCES / s).resolve()}"' for s in kernels.UNITS[0]]
    written = [p.stat().st_mtime_ns for p in paths]
    kernels.write_units(tmp_path)
    assert [p.stat().st_mtime_ns for p in paths] == written


def transformers_rms_norm(x, weight, eps):
    """LlamaRMSNorm's arithmetic: float32 normalisation, rounded to x's dtype, then times the weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def close_in_float16(a, b) -> bool:
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hidden", [576, 64, 40, 7])  # multiples of the 16-float vector and not
def test_rms_norm_kernel_computes_what_transformers_does(tier_kernels, hidden):
    torch.manual_seed(hidden)
    x, residual = torch.randn(2, 33, hidden).unbind(0)
    weight = torch.randn(hidden)
    kernels = tier_kernels
    # bfloat16: the same bits, the double rounding included; float16's finer steps show that the two sum the
    # squares in other orders (1 step at most)
    for dtype, same in ((torch.bfloat16, torch.equal), (torch.float16, close_in_float16)):
        xd, rd, wd = x.to(dtype), residual.to(dtype), weight.to(dtype)
        (y,) = kernels.rms_norm(xd, None, wd, 1e-5)
        assert same(y, transformers_rms_norm(xd, wd, 1e-5))
        y, total = kernels.rms_norm(xd, rd, wd, 1e-5)
        assert torch.equal(total, xd + rd)
        assert same(y, transformers_rms_norm(xd + rd, wd, 1e-5))
    (y,) = kernels.rms_norm(x, None, weight, 1e-5)  # float32: the sum of squares in another order
    torch.testing.assert_close(y, F.rms_norm(x, (hidden,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    # without a weight (Gemma 4's values): the float32 norm rounded once to x's dtype, as F.rms_norm of x in
    # float32 then .to(dtype) gives, the same bits as a weight of ones
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        (y,) = kernels.rms_norm(xd, None, None, 1e-5)
        assert torch.equal(y, kernels.rms_norm(xd, None, torch.ones(hidden, dtype=dtype), 1e-5)[0])
        want = F.rms_norm(xd.float(), (hidden,), eps=1e-5).to(dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
        else:  # where the float32 sums differ in their last bit, a value may round the other way: one step
            assert (y != want).float().mean() < 0.01
            torch.testing.assert_close(y, want, rtol=2**-7, atol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_kernel_gives_a_row_the_same_bits_in_any_batch(tier_kernels, dtype):
    torch.manual_seed(1)
    x, residual = torch.randn(2, 300, 576).to(dtype).unbind(0)
    weight = torch.randn(576).to(dtype)
    kernels = tier_kernels
    batch = kernels.rms_norm(x, residual, weight, 1e-6)
    for rows in (slice(0, 1), slice(17, 18), slice(5, 37), slice(299, 300)):
        alone = kernels.rms_norm(x[rows], residual[rows], weight, 1e-6)
        assert all(torch.equal(a, b[rows]) for a, b in zip(alone, batch, strict=True))


@pytest.mark.timeout(60)
def test_rms_norm_kernel_refuses_what_it_cannot_take():
    kernels = cpu_kernels()
    with pytest.raises(RuntimeError, match="weight"):
        kernels.rms_norm(torch.randn(3, 8), None, torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.rms_norm(
            torch.randn(3, 8, dtype=torch.float64), None, torch.randn(8, dtype=torch.float64), 1e-6
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_rounds_as_transformers_does(tier_kernels, dtype):
    """silu(gate) * up from [gate, up]: transformers' LlamaMLP rounds after silu and after the product."""
    x = (torch.randn(9, 2 * 40) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = tier_kernels.silu_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # exp may differ in its last float32 bit from torch's vectorised one: at most one bfloat16 step apart
        assert (got.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-7
        assert (got == expected).float().mean() > 0.98
