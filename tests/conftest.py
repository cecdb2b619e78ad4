"""Shared fixtures: tiny random Hugging Face models built on the fly, the real default model, and kvserve's C++
kernels as built for every CPU tier this host can execute."""

import os
from pathlib import Path

import pytest

from model import cpu_tier
from tests.helpers.tiny_models import CpuPath, build_tiny_model


def pytest_terminal_summary(terminalreporter):
    """Which CPU tier this run computed as (CI's log says it), and which others the tier tests covered."""
    tier, why = cpu_tier.select()
    runnable = ", ".join(t.name for t in cpu_tier.runnable())
    terminalreporter.write_line(f"kvserve CPU tier: {tier.name} ({why}); kernel tests ran on: {runnable}")


@pytest.fixture(params=[t.name for t in cpu_tier.runnable()])
def tier_kernels(request):
    """kvserve's C++ kernels as built for each tier this CPU can execute (an AVX-512 host: its own, avx2 and
    generic), for the kernels' own tests: every tier computes its own bits, each must be right and invariant."""
    from model.kernels import load

    return load(request.param)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct), fetched and converted once into the weights folder."""
    from weights.fetch import ensure_default_model
    from weights.store import weights_dir

    return ensure_default_model(weights_dir(os.environ.get("KVSERVE_WEIGHTS_DIR")), progress=False)


@pytest.fixture(params=["cpp", "torch"])
def cpu_path(request) -> CpuPath:
    """Each model test runs once with each CPU path (the C++ kernels, PyTorch ops)."""
    return CpuPath(request.param == "cpp")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Google's Gemma 3 270M (base, Q4_K_M) GGUF, fetched once into the weights folder: a real gemma3 file with a
    262,144-piece SentencePiece vocabulary. Tests using it are marked slow."""
    from weights.fetch import gemma3_270m_gguf
    from weights.store import weights_dir

    return gemma3_270m_gguf(weights_dir(os.environ.get("KVSERVE_WEIGHTS_DIR")), progress=False)
