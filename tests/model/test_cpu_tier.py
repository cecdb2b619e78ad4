"""The CPU tier kvserve runs as (model/cpu_tier.py) and the kernels built for it at install (model/kernels.py):
chosen from the CPU, forced only to a tier the CPU has, each tier's own numbers, and a start that never compiles."""

import os
import subprocess
import sys

import pytest
import torch

from model import cpu_tier, kernels
from server.engine.config import EngineConfig
from server.engine.engine import Engine

AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be a CPU with the given flags and torch dispatch level."""

    def pretend(flags: frozenset[str], capability: str = "avx512", tiles_granted: bool = True):
        monkeypatch.setattr(cpu_tier, "cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu_tier, "torch_capability", lambda: capability)
        monkeypatch.setattr(cpu_tier, "amx_granted", lambda: tiles_granted)

    return pretend


@pytest.mark.timeout(10)
def test_each_cpu_gets_its_best_tier_and_its_own_numbers(cpu):
    cpu(ZEN4)
    tier, why = cpu_tier.select()
    assert tier.name == "avx512bf16" and tier.dtype == torch.bfloat16 and "best this CPU runs" in why
    assert [t.name for t in cpu_tier.runnable()] == ["avx512bf16", "avx512", "avx2", "generic"]
    cpu(AVX2_ONLY, "avx2")
    tier, _ = cpu_tier.select()
    assert tier.name == "avx2" and tier.dtype == torch.float32  # no bfloat16 arithmetic: float32 activations
    assert [t.name for t in cpu_tier.runnable()] == ["avx2", "generic"]
    cpu(frozenset())  # another architecture, or no /proc/cpuinfo
    assert cpu_tier.select()[0].name == "generic"


@pytest.mark.timeout(10)
def test_a_xeon_with_amx_runs_on_tiles_where_linux_grants_them(cpu):
    cpu(SAPPHIRE_RAPIDS)
    tier, why = cpu_tier.select()
    assert tier.name == "amx" and "refused" not in why
    assert tier.dtype == torch.float32 and tier.kv_dtype == torch.bfloat16  # 16-bit parts on the tiles
    assert [t.name for t in cpu_tier.runnable()] == ["amx", "avx512bf16", "avx512", "avx2", "generic"]
    cpu(SAPPHIRE_RAPIDS, tiles_granted=False)  # a kernel (or a sandbox) that keeps the tile state to itself
    tier, why = cpu_tier.select()
    assert tier.name == "avx512bf16" and "amx: Linux refused this process the tile state" in why
    with pytest.raises(ValueError, match="CPU tier 'amx' needs the tile state, which Linux refused it"):
        cpu_tier.select("amx")
    cpu(ZEN4)  # AVX-512 BF16 without AMX: nothing refused, nothing said
    tier, why = cpu_tier.select()
    assert tier.name == "avx512bf16" and "refused" not in why
    with pytest.raises(ValueError, match="needs amx_tile, amx_int8"):
        cpu_tier.select("amx")


@pytest.mark.timeout(10)
def test_the_tests_run_the_tile_kernels_emulated_where_only_the_tiles_are_missing(cpu):
    """make test builds the amx tier's module where the CPU runs all of it but its tiles (a Zen 4, or a Xeon
    whose tile state Linux refused), and the tile kernels' tests run it on the software model of the tiles."""
    cpu(ZEN4)
    assert [t.name for t in cpu_tier.emulated()] == ["amx"]
    assert [t.name for t in kernels.named_tiers("test")] == ["avx512bf16", "avx512", "avx2", "generic", "amx"]
    cpu(SAPPHIRE_RAPIDS, tiles_granted=False)
    assert [t.name for t in cpu_tier.emulated()] == ["amx"]
    cpu(SAPPHIRE_RAPIDS)  # the real instructions: nothing emulated
    assert cpu_tier.emulated() == [] and kernels.named_tiers("test") == cpu_tier.runnable()
    cpu(ZEN4 - {"avx512_bf16"})  # the tier's own vector code would not run
    assert cpu_tier.emulated() == []
    cpu(AVX2_ONLY)
    assert cpu_tier.emulated() == [] and [t.name for t in kernels.named_tiers("test")] == ["avx2", "generic"]


@pytest.mark.timeout(10)
def test_the_grant_is_asked_of_linux_once(monkeypatch):
    """The real request (arch_prctl), made at most once per process; its answer matches the CPU's flags where
    Linux has AMX at all (a CPU without it is always refused)."""
    cpu_tier.amx_granted.cache_clear()
    granted = cpu_tier.amx_granted()
    assert cpu_tier.amx_granted() is granted and cpu_tier.amx_granted.cache_info().misses == 1
    if "amx_tile" not in cpu_tier.cpu_flags():
        assert not granted


@pytest.mark.timeout(10)
def test_torchs_own_dispatch_level_caps_the_automatic_choice(cpu):
    cpu(ZEN4, capability="avx2")  # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host
    tier, why = cpu_tier.select()
    assert tier.name == "avx2" and "ATEN_CPU_CAPABILITY=avx2" in why


@pytest.mark.timeout(10)
def test_a_tier_is_forced_only_where_the_cpu_has_it(cpu):
    cpu(ZEN4, capability="avx512")
    tier, why = cpu_tier.select("avx2")
    # torch still dispatching at AVX-512: said, with the variables that make the whole process an AVX2 one
    assert tier.name == "avx2" and "ATEN_CPU_CAPABILITY=avx2" in why and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    cpu(AVX2_ONLY, "avx2")
    with pytest.raises(ValueError, match="needs avx512f.*lacks; it runs avx2, generic"):
        cpu_tier.select("avx512bf16")
    with pytest.raises(ValueError, match="unknown CPU tier 'avx3'"):
        cpu_tier.select("avx3")


@pytest.mark.timeout(10)
def test_each_tier_is_compiled_for_its_own_instructions():
    flags = {t.name: t.cflags for t in cpu_tier.TIERS}
    assert "-mavx512bf16" in flags["avx512bf16"] and "-mavx512bf16" not in flags["avx512"]
    assert "-mavx512f" in flags["avx512"] and not any("avx512" in f for f in flags["avx2"])
    assert {"-mavx2", "-mfma", "-mf16c"} <= set(flags["avx2"]) and flags["generic"] == ()
    assert {"-mamx-tile", "-mamx-int8", "-mavx512bf16"} <= set(flags["amx"])
    assert not any("amx" in f for t in cpu_tier.TIERS if t.name != "amx" for f in t.cflags)


@pytest.mark.timeout(10)
def test_the_install_builds_the_servers_tier_alone_or_every_tier_the_tests_run(cpu, monkeypatch):
    """`make serve` builds `auto`: the one tier `kvserve serve` would run as on this CPU (KVSERVE_CPU_TIER, its
    --cpu-tier, included); `make test` builds `runnable`, each tier the kernel tests run."""
    monkeypatch.delenv("KVSERVE_CPU_TIER", raising=False)
    cpu(ZEN4)
    assert [t.name for t in kernels.named_tiers("auto")] == [cpu_tier.select()[0].name] == ["avx512bf16"]
    assert [t.name for t in kernels.named_tiers("runnable")] == ["avx512bf16", "avx512", "avx2", "generic"]
    cpu(ZEN4, capability="avx2")  # torch capped: so is the server, and so is what it waits for
    assert [t.name for t in kernels.named_tiers("auto")] == ["avx2"]
    cpu(ZEN4)
    monkeypatch.setenv("KVSERVE_CPU_TIER", "avx2")
    assert [t.name for t in kernels.named_tiers("auto")] == ["avx2"]
    cpu(AVX2_ONLY, "avx2")
    monkeypatch.setenv("KVSERVE_CPU_TIER", "avx512")
    with pytest.raises(ValueError, match="lacks"):  # the start would refuse it too, saying the same
        kernels.named_tiers("auto")
    assert [t.name for t in kernels.named_tiers("avx2, generic")] == ["avx2", "generic"]
    assert len(kernels.named_tiers("all")) == len(cpu_tier.platform_tiers())


@pytest.fixture
def installed_kernels() -> str | None:
    """Where this install's kernels are built as the suite found it: KVSERVE_KERNELS_DIR's folder (an install
    may be told to build there), or None for the install's own."""
    return os.environ.get("KVSERVE_KERNELS_DIR")


@pytest.fixture
def empty_install(installed_kernels, tmp_path, monkeypatch):
    """A kernels folder with nothing built in it, and load()'s cache cleared before and after."""
    monkeypatch.setenv("KVSERVE_KERNELS_DIR", str(tmp_path))
    kernels.load.cache_clear()
    yield tmp_path
    kernels.load.cache_clear()


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(30)
def test_a_start_never_compiles_and_names_the_install_command(empty_install, monkeypatch, tiny_llama_dir):
    import torch.utils.cpp_extension

    def compile_(*args, **kwargs):
        raise AssertionError("a start compiled")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_)
    monkeypatch.setattr(torch.utils.cpp_extension, "_write_ninja_file_and_build_library", compile_)
    with pytest.raises(
        kernels.KernelsNotBuilt, match=r"not built for these sources.*model\.kernels build --tiers generic"
    ):
        kernels.load("generic")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "generate",
            "--model",
            str(tiny_llama_dir),  # a model that is there: the start gets as far as the kernels
            "--prompt",
            "x",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVSERVE_KERNELS_DIR": str(empty_install)},
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "model.kernels build --tiers" in out.stderr  # the command that builds the missing tier


@pytest.mark.timeout(30)
def test_a_failed_build_is_recorded_and_runs_pytorch_ops_with_a_warning(empty_install, monkeypatch, caplog):
    import torch.utils.cpp_extension

    from server.engine.backend import select_cpu_kernels

    def no_compiler(*args, **kwargs):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "_write_ninja_file_and_build_library", no_compiler)
    generic = cpu_tier.BY_NAME["generic"]
    with pytest.raises(RuntimeError, match="command not found"):
        kernels.build(generic)
    assert "command not found" in (kernels.build_folder(generic) / kernels.FAILED).read_text()
    assert select_cpu_kernels("auto", generic) is None
    assert "could not be built at install" in caplog.text and "command not found" in caplog.text
    with pytest.raises(RuntimeError, match="--cpu-kernels on"):
        select_cpu_kernels("on", generic)
    assert select_cpu_kernels("off", generic) is None


@pytest.mark.timeout(30)
def test_builds_are_kept_per_tier_and_per_version_of_the_sources(
    empty_install, monkeypatch, tmp_path_factory
):
    sources = tmp_path_factory.mktemp("csrc")
    for path in kernels.SOURCES.iterdir():
        (sources / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(kernels, "SOURCES", sources)
    avx2, generic = cpu_tier.BY_NAME["avx2"], cpu_tier.BY_NAME["generic"]
    before = kernels.build_folder(avx2)
    assert before.parent == empty_install and before.name.startswith("avx2-")
    assert kernels.build_folder(generic) != before and kernels.build_folder(avx2) == before
    (sources / "vec.h").write_text((sources / "vec.h").read_text() + "\n// an edit\n")
    assert kernels.build_folder(avx2) != before  # an edited source is a stale build, never loaded


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tier", [t.name for t in cpu_tier.runnable()])
def test_the_engine_runs_as_any_tier_this_cpu_has(tiny_model_factory, tier, caplog):
    with caplog.at_level("INFO"):
        engine = Engine(tiny_model_factory("llama"), EngineConfig(kv_cache_memory=8 << 20, cpu_tier=tier))
    expected = cpu_tier.BY_NAME[tier]
    assert engine.runner.dtype == expected.dtype
    assert engine.stats().kv_cache_dtype == str(expected.kv_dtype)[6:]
    assert f"CPU tier {tier} (" in caplog.text
    assert engine.score(list(range(3, 20))).isfinite().all()


@pytest.mark.timeout(30)
def test_an_install_built_for_a_weaker_cpu_runs_the_best_tier_it_built(
    installed_kernels, empty_install, caplog
):
    """An image built on another host (or an install told to build fewer tiers) starts on the best tier it
    has and says so; a tier named outright that is not built is the install command's error."""
    import shutil

    from server.engine.backend import select_cpu_kernels, select_cpu_tier

    best, generic = cpu_tier.select()[0], cpu_tier.BY_NAME["generic"]
    if best is generic:
        pytest.skip("this CPU's best tier is the generic one: nothing weaker to have built")
    real = kernels.build_folder(generic).name
    kernels.load.cache_clear()
    with pytest.MonkeyPatch.context() as env:  # the generic build of this install, wherever it was made
        if installed_kernels:
            env.setenv("KVSERVE_KERNELS_DIR", installed_kernels)
        else:
            env.delenv("KVSERVE_KERNELS_DIR")
        shutil.copytree(kernels.build_folder(generic), empty_install / real)
    with caplog.at_level("INFO"):
        tier = select_cpu_tier("auto", "auto")
    assert tier is generic and select_cpu_kernels("auto", tier) is not None
    assert f"{best.name} would be, but this install built the kernels for generic" in caplog.text
    assert "scripts/install.sh" in caplog.text
    with pytest.raises(kernels.KernelsNotBuilt, match=best.name):
        select_cpu_kernels("auto", select_cpu_tier(best.name, "auto"))


@pytest.mark.timeout(10)
def test_the_kv_cache_holds_bfloat16_unless_asked_otherwise():
    from server.engine.backend import select_kv_cache_dtype

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    for tier in cpu_tier.TIERS:  # storage only: half float32's bytes, read by a shift
        assert select_kv_cache_dtype("auto", f32, tier) == bf16 == select_kv_cache_dtype("auto", bf16, tier)
    assert select_kv_cache_dtype("auto", f16, cpu_tier.BY_NAME["avx2"]) == f16
    assert select_kv_cache_dtype("auto", bf16, None) == bf16  # a GPU: the model's
    # twice the bytes, if wanted
    assert select_kv_cache_dtype("float32", f32, cpu_tier.BY_NAME["avx2"]) == f32
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 with bfloat16 activations"):
        select_kv_cache_dtype("float32", bf16, cpu_tier.BY_NAME["avx512bf16"])
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype 'fp8'"):
        select_kv_cache_dtype("fp8", f32, None)


def test_int8_activations_are_the_default_only_where_a_kernel_has_them(caplog):
    """The quantized GEMMs round activations to int8 by default (`auto`) with the avx512bf16 tier's kernel on
    bfloat16 activations (AVX512-VNNI with BF16) and the avx2 tier's on any; anywhere else they keep the tier's
    own, silently for `auto`, with a warning for an explicit `int8`; `wide` always keeps the tier's own."""
    import logging

    from server.engine.backend import select_gemm_activations

    built = {t.name: kernels.load(t.name) for t in cpu_tier.runnable()}
    with pytest.raises(ValueError, match="auto, int8 or wide"):
        select_gemm_activations("int4", built["generic"], torch.float32)
    rounds = {"avx512bf16": ("bfloat16",), "avx2": ("bfloat16", "float32")}
    for name, module in built.items():
        assert tuple(module.gemm_int8) == rounds.get(name, ())
        dtype = cpu_tier.BY_NAME[name].dtype
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            assert select_gemm_activations("auto", module, dtype) == (name in rounds)
            assert not caplog.text
            assert select_gemm_activations("wide", module, dtype) is False
            assert not caplog.text
            taken = select_gemm_activations("int8", module, dtype)
        assert taken == (name in rounds) and (taken or "take the tier's own" in caplog.text)
    assert select_gemm_activations("int8", None, torch.bfloat16) is False  # PyTorch ops
    assert select_gemm_activations("auto", None, torch.bfloat16) is False
    if "avx512bf16" in built:
        assert select_gemm_activations("int8", built["avx512bf16"], torch.float32) is False
        assert select_gemm_activations("auto", built["avx512bf16"], torch.float32) is False
