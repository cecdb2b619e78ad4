"""Shared fixtures: tiny random Hugging Face models built on the fly, the real default model, and kvserve's C++
kernels as built for every CPU tier this host can execute; and the rule that keeps `make test-fast` fast.

The rule: a test that needs the real default model (or the real Gemma 3 file), a browser, a container engine, a
live `kvserve serve` replica or a download of a third-party tool is marked `slow`, or it fails. It is checked
twice: by the fixtures a test uses (HEAVY_FIXTURES, before any of them is set up), and where the heavy thing
starts (guard_heavy_starts: fetching the real model in this process, or starting such a process).
"""

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# Without a GPU, the GPU's Triton kernels (model/attention_triton.py) run under Triton's interpreter: their own code
# with numpy's arithmetic. Set before anything imports triton (transformers may): triton.jit, its standard
# library's too, reads it when a function is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model import cpu_tier  # noqa: E402
from tests.helpers.tiny_models import CpuPath, build_tiny_model  # noqa: E402
from weights import fetch  # noqa: E402
from weights.store import weights_dir  # noqa: E402

# fixture -> what it gives a test that makes the test slow; a fixture using one of these is covered too
# (pytest lists every fixture a test needs, however deep, in item.fixturenames)
HEAVY_FIXTURES = {
    "default_model_dir": "the real default model",
    "gemma3_gguf": "the real Gemma 3 270M GGUF",
    "browser": "a browser (chromium through selenium)",
    "oci_engine": "a container engine (podman or docker)",
    "spawn": "live `kvserve serve` replicas",
    "hostile_server": "a live `kvserve serve` replica",
    "fleet": "live `kvserve serve` replicas behind a router",
    "prometheus_bin": "a Prometheus server installed with apt-get",
    "llama_cpp_tree": "llama.cpp's sources, downloaded",
    "claude": "Claude Code, installed from npm",
    "codex": "Codex, installed from npm",
}
# The weights folder the real models live in, as the run started (a test may point KVSERVE_WEIGHTS_DIR elsewhere).
REAL_WEIGHTS = weights_dir(os.environ.get("KVSERVE_WEIGHTS_DIR")).resolve()


def not_slow(what: str, nodeid: str) -> str:
    return (
        f"{nodeid} needs {what} but is not marked slow: mark it @pytest.mark.slow (or the module, "
        "pytestmark = pytest.mark.slow) so that `make test-fast` stays fast; `make test` runs it"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """Fail an unmarked test that asks for a heavy fixture before that fixture is set up; guard the rest of its
    setup (guard_heavy_starts)."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    heavy = [what for name, what in HEAVY_FIXTURES.items() if name in item.fixturenames]
    if heavy:
        pytest.fail(not_slow(" and ".join(heavy), item.nodeid), pytrace=False)
    with guard_heavy_starts(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """While an unmarked test runs, the real models cannot be fetched in this process and no heavy process can
    start. Teardown is not guarded: a module's or session's fixtures of slow tests end in the teardown of
    whichever test comes last, marked or not (an image test's container engine cleaned up after hadolint's)."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with guard_heavy_starts(item.nodeid):
        return (yield)


@contextmanager
def guard_heavy_starts(nodeid: str) -> Iterator[None]:
    """Refuse, with not_slow's message: weights.fetch resolving a real model in the real weights folder (the
    fixtures and `kvserve` in-process both come through it), and a subprocess that is a browser, a container
    engine, a `kvserve serve` replica, or `kvserve` on the real weights folder."""

    def refusal(what: str) -> BaseException:
        return pytest.fail.Exception(not_slow(what, nodeid), pytrace=False)

    def refuse_real(resolve, what: str):
        def guarded(folder: Path, *args, **kwargs):
            if Path(folder).resolve() == REAL_WEIGHTS:
                raise refusal(what)
            return resolve(folder, *args, **kwargs)

        return guarded

    class GuardedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            if (what := heavy_process(args)) is not None:
                raise refusal(what)
            super().__init__(args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            fetch, "ensure_default_model", refuse_real(fetch.ensure_default_model, "the real default model")
        )
        patch.setattr(fetch, "default_gguf", refuse_real(fetch.default_gguf, "the real default model"))
        patch.setattr(
            fetch, "gemma3_270m_gguf", refuse_real(fetch.gemma3_270m_gguf, "the real Gemma 3 270M GGUF")
        )
        patch.setattr(subprocess, "Popen", GuardedPopen)  # subprocess.run and check_output start through it
        yield


CONTAINER_ENGINES = {"podman", "docker", "podman-compose", "docker-compose", "image.sh"}
BROWSERS = {"chromium", "chromedriver", "chrome", "google-chrome"}


def heavy_process(args) -> str | None:
    """What a subprocess's command line starts, if it is heavy: a browser, a container engine, a live
    `kvserve serve`, or kvserve on the real weights folder (in which the real default model lives)."""
    argv = [os.fspath(a) for a in ([args] if isinstance(args, (str, os.PathLike)) else args)]
    if not argv:
        return None
    words = argv[0].split() if len(argv) == 1 else argv  # a shell string: its words, roughly
    names = [Path(w).name for w in words]
    if names[0] in BROWSERS:
        return "a browser"
    if CONTAINER_ENGINES & set(names[:2]):  # the engine, or `bash scripts/image.sh`
        return "a container engine"
    kvserve = next((i for i, w in enumerate(words) if w == "server.cli" or Path(w).name == "kvserve"), None)
    if kvserve is None:
        return None
    rest = words[kvserve + 1 :]
    if {"-h", "--help"} & set(rest):
        return None
    if rest[:1] == ["serve"]:
        return "a live `kvserve serve` replica"
    if any(REAL_WEIGHTS in Path(w).resolve().parents for w in rest if w.startswith("/")):
        return "the real default model"
    return None


def pytest_terminal_summary(terminalreporter):
    """Which CPU tier this run computed as (CI's log says it), and which others the tier tests covered."""
    tier, why = cpu_tier.select()
    runnable = ", ".join(t.name for t in cpu_tier.runnable())
    emulated = "".join(f", {t.name} (its tiles emulated)" for t in cpu_tier.emulated())
    terminalreporter.write_line(
        f"kvserve CPU tier: {tier.name} ({why}); kernel tests ran on: {runnable}{emulated}"
    )


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
    """The embedded default model (SmolLM2-135M-Instruct), fetched and converted once into the weights folder.
    Tests using it are marked slow."""
    return fetch.ensure_default_model(REAL_WEIGHTS, progress=False)


@pytest.fixture(scope="session")
def triton_here() -> None:
    """The GPU's Triton kernels (model/attention_triton.py) run on the CPU, under Triton's interpreter (set above).
    A machine with a GPU compiles them instead: there the `cuda` tests run them on the device."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is here: its Triton kernels run compiled, in the `cuda` tests, not on the CPU")


@pytest.fixture(params=["cpp", "torch"])
def cpu_path(request) -> CpuPath:
    """Each model test runs once with each CPU path (the C++ kernels, PyTorch ops)."""
    return CpuPath(request.param == "cpp")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Google's Gemma 3 270M (base, Q4_K_M) GGUF, fetched once into the weights folder: a real gemma3 file with a
    262,144-piece SentencePiece vocabulary. Tests using it are marked slow."""
    return fetch.gemma3_270m_gguf(REAL_WEIGHTS, progress=False)
