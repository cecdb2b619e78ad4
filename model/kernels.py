"""kvserve's C++ kernels for the CPU (model/csrc: paged attention, RMSNorm, SwiGLU, quantized GEMMs, the layer
loop), one build per CPU tier (model/cpu_tier.py).

They are compiled at install time, never when a server starts: scripts/install.sh runs
`python -m model.kernels build`, which builds the tier a server here runs as (`--tiers auto`: what `make serve`
waits for), every tier this CPU can run (`runnable`), those and the tiers whose tile kernels the tests run
emulated here (`test`: `make test`) or every tier of the platform (`all`: images that run on other hosts) into
the install's own folder, one sub-folder per tier and hash of the sources, flags and torch version. A start
loads the module of its tier from there, or fails with the command that builds it: a missing or stale build is never rebuilt behind the user's back, and no
start waits on another process's compiler. Where a build failed at install (no C++ compiler) the failure is
recorded and kvserve runs PyTorch ops instead, with a warning (`--cpu-kernels off` asks for that outright).
"""

import argparse
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from model import cpu_tier
from model.cpu_tier import CpuTier

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
# The sources compile as two translation units, each a file of #includes written into the build's work folder
# (a unity build): one source a unit, each spent most of its compile on the ATen headers it includes (15 units,
# ~280 CPU-seconds a tier on 2-core Zen 3, most of a first `make serve`; these two: ~130, side by side). The
# quantized GEMM's templates, the longest, are one unit; the rest, the other.
UNITS = (
    ("quant_gemm_i16.cpp", "quant_gemm_i8.cpp"),
    ("kernels.cpp", "paged_attention.cpp", "paged_attention_amx.cpp", "rms_norm.cpp", "activation.cpp", "quant_gemm.cpp", "quant_gemm_bf16.cpp",
     "quant_gemm_amx.cpp", "quant_gemm_f32.cpp", "quant_pack.cpp", "layer_stack.cpp", "moe.cpp", "noise.cpp", "argmax.cpp", "deltanet.cpp"),
)  # fmt: skip
FAILED = "FAILED"  # a build folder holding this file records why the build failed
TREE = "TREE"  # and this one, which source tree built it (a hash of its path)


class KernelsNotBuilt(RuntimeError):
    pass


def build_command(tier: str) -> str:
    """What builds one tier's kernels, for the errors and warnings that find them missing."""
    return f"python -m model.kernels build --tiers {tier} (in kvserve's venv; or: bash scripts/install.sh --test)"


def kernels_dir() -> Path:
    """Where this install keeps its builds: KVSERVE_KERNELS_DIR, else inside the install's prefix (the venv)."""
    return Path(os.environ.get("KVSERVE_KERNELS_DIR") or Path(sys.prefix) / "share" / "kvserve" / "kernels")


def module_name(tier: CpuTier) -> str:
    return "kvserve_cpu_kernels_" + tier.name


def build_folder(tier: CpuTier) -> Path:
    """The folder of this tier's build of these exact sources, for this torch and Python."""
    h = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(
        " ".join(tier.cflags).encode() + torch.__version__.encode() + sys.implementation.cache_tag.encode()
    )
    h.update(repr(UNITS).encode())
    return kernels_dir() / f"{tier.name}-{h.hexdigest()[:16]}"


def module_file(tier: CpuTier) -> Path:
    """The built module of this tier's build folder (present once a build succeeded)."""
    return build_folder(tier) / (module_name(tier) + ".so")


def build(tier: CpuTier) -> Path:
    """Compile the kernels for `tier` into its build folder (nothing to do when they are there). A failure is
    recorded in the folder and raised. ninja works in one folder per tier, so an edit recompiles only what it
    touched; the module is then copied into the build folder under a temporary name and renamed, so a killed
    build leaves nothing half-made where a start looks."""
    so = module_file(tier)
    final = so.parent
    if so.is_file():
        return final
    # one work folder (and one set of builds) per source tree: two checkouts sharing a venv (git worktrees) once
    # compiled into each other's folder, and each build removed the other's as older
    tree = hashlib.sha256(str(SOURCES.resolve()).encode()).hexdigest()[:8]
    work = kernels_dir() / f".work-{tier.name}-{tree}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        _compile(tier, work)
    except Exception as e:
        final.mkdir(parents=True, exist_ok=True)
        (final / FAILED).write_text(f"{type(e).__name__}: {e}\n")
        raise
    for old in kernels_dir().glob(f"{tier.name}-*"):  # this tree's builds of older sources, or a failure
        if (old / TREE).is_file() and (old / TREE).read_text() != tree:
            continue
        shutil.rmtree(old, ignore_errors=True)
    final.mkdir(parents=True)
    (final / TREE).write_text(tree)
    partial = final / (so.name + ".partial")
    shutil.copyfile(work / so.name, partial)
    partial.rename(so)
    return final


def _compile(tier: CpuTier, work: Path) -> None:
    """ninja-build the module in `work` with torch's own build recipe, without importing it: torch's load()
    imports what it built, and the module of a tier this CPU cannot run faults when loaded (an image builds every
    tier). Nor does this take load()'s lock file, which a killed build used to leave behind, hanging every later
    start until it was removed by hand."""
    from torch.utils import cpp_extension

    try:  # the ninja that pip installed beside kvserve, also when its venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    build_library = cpp_extension._write_ninja_file_and_build_library
    arguments = dict(
        name=module_name(tier),
        sources=[str(path) for path in write_units(work)],
        # -fopenmp: at::parallel_for runs on torch's OpenMP threads (the same libgomp, already loaded)
        extra_cflags=["-O3", "-fopenmp", *tier.cflags],
        extra_cuda_cflags=[],
        extra_sycl_cflags=[],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[],
        build_directory=str(work),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
        is_standalone=False,
    )
    accepted = inspect.signature(build_library).parameters  # its arguments grew over torch's versions
    build_library(**{k: v for k, v in arguments.items() if k in accepted})


def write_units(work: Path) -> list[Path]:
    """UNITS as files in `work`, each #including its sources by absolute path; a file is rewritten only when its
    text changes, so that ninja (which also tracks the headers and sources each includes) recompiles only the units
    an edit touched."""
    paths = []
    for i, sources in enumerate(UNITS):
        path = work / f"unit{i}.cpp"
        text = "".join(f'#include "{(SOURCES / source).resolve()}"\n' for source in sources)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        paths.append(path)
    return paths


def built(tier: CpuTier) -> bool:
    """Whether the install built (or tried to build: see load) the kernels of these sources for `tier`."""
    so = module_file(tier)
    return so.is_file() or (so.parent / FAILED).is_file()


@functools.cache
def load(name: str):
    """The built module of the named tier. Raises KernelsNotBuilt when it is missing or was built from other
    sources; returns None where its build failed at install (logged)."""
    tier = cpu_tier.BY_NAME[name]
    so = module_file(tier)
    folder = so.parent
    if not so.is_file():
        if (folder / FAILED).is_file():
            reason = (folder / FAILED).read_text().strip().splitlines()[-1]
            log.warning("the C++ CPU kernels could not be built at install, using PyTorch ops: %s", reason)
            return None
        raise KernelsNotBuilt(
            f"kvserve's C++ CPU kernels for the {name} tier are not built for these sources (no {folder}): run "
            f"{build_command(name)}, or serve with --cpu-kernels off"
        )
    spec = importlib.util.spec_from_file_location(module_name(tier), so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_kernels(tier: str = "auto"):
    """The compiled module for a CPU tier (default: the one this process runs as), or None where its build
    failed at install. Raises KernelsNotBuilt when it was never built for these sources."""
    return load(cpu_tier.select(tier)[0].name)


def named_tiers(spec: str) -> list[CpuTier]:
    """The tiers --tiers names: runnable, test (runnable, and the tiers whose tile kernels run emulated here),
    auto (the one `kvserve serve` runs as here: KVSERVE_CPU_TIER is its --cpu-tier), all, or names,
    comma-separated."""
    if spec == "runnable":
        return cpu_tier.runnable()
    if spec == "test":
        return cpu_tier.runnable() + cpu_tier.emulated()
    if spec == "auto":
        return [cpu_tier.select(os.environ.get("KVSERVE_CPU_TIER") or "auto")[0]]
    if spec == "all":
        return list(cpu_tier.platform_tiers())
    return [cpu_tier.BY_NAME[n.strip()] for n in spec.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m model.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command",
        choices=["build", "check"],
        help="build: compile what is missing (a failure only warns: kvserve then runs PyTorch ops); check: "
        "fail unless every tier is built, and each this CPU runs loads",
    )
    parser.add_argument(
        "--tiers",
        default=os.environ.get("KVSERVE_KERNEL_TIERS", "runnable"),
        help="runnable (the tiers this CPU runs), test (those, and the tiers whose tile kernels the tests run "
        "on a software model of the tiles here), auto (the one `kvserve serve` runs as here), all (every tier "
        "of this platform), or names, comma-separated",
    )
    args = parser.parse_args()
    tiers = named_tiers(args.tiers)
    if args.command == "check":
        # a tier this CPU cannot run is only looked for: loading it would fault
        ok = [module_file(t).is_file() for t in tiers]
        ok += [load(t.name) is not None for t in tiers if t in cpu_tier.runnable()]
        print(
            f"kvserve's CPU kernels: {', '.join(t.name for t in tiers)}: {'ok' if all(ok) else 'NOT BUILT'}"
        )
        return 0 if all(ok) else 1
    for tier in tiers:
        try:
            print(f"kvserve's CPU kernels, {tier.name} tier: {build(tier)}")
        except Exception as e:  # no compiler: kvserve still runs, on PyTorch ops (see load)
            print(
                f"warning: kvserve's CPU kernels, {tier.name} tier, could not be built: {e}", file=sys.stderr
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
