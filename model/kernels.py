"""kvserve's C++ kernels for the CPU (model/csrc: paged attention, RMSNorm, SwiGLU, quantized GEMMs), compiled with
torch.utils.cpp_extension and cached on disk.

Where they cannot be built (no C++ compiler, an unusual platform) kvserve logs why and runs PyTorch ops
instead; `--cpu-kernels off` asks for that outright. scripts/install.sh builds them (~40 s, once per machine
and source version), else the first use does; TORCH_EXTENSIONS_DIR says where builds are kept (default
~/.cache/torch_extensions).
"""

import functools
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"


def cpu_flags() -> tuple[str, list[str]]:
    """The instruction-set level to compile for and its flags, from what torch found on this CPU plus
    AVX512-BF16 from /proc/cpuinfo (not -march=native, so that a build cached on a shared disk never meets a
    CPU that lacks them: the build's name says its level)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic", []
    level = torch.backends.cpu.get_cpu_capability()
    if level.startswith("AVX512"):
        flags = ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"]
        if _has_avx512_bf16():  # one instruction for the quantized GEMMs' bfloat16 pair products
            return "avx512bf16", [*flags, "-mavx512bf16"]
        return "avx512f", flags
    if level == "AVX2":
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


def _has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


@functools.cache
def cpu_kernels():
    """The compiled module (paged_attention, rms_norm), or None where it cannot be built."""
    from torch.utils.cpp_extension import load

    try:  # the ninja that pip installed beside kvserve, also when its venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    level, flags = cpu_flags()
    name = "kvserve_cpu_kernels_" + level
    sources = [
        str(SOURCES / f)
        for f in (
            "kernels.cpp",
            "paged_attention.cpp",
            "rms_norm.cpp",
            "activation.cpp",
            "quant_gemm.cpp",
            "layer_stack.cpp",
        )
    ]
    try:
        # -fopenmp: at::parallel_for runs on torch's OpenMP threads (the same libgomp, already loaded)
        return load(
            name,
            sources,
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # compiler or ninja missing, build error: the PyTorch path still works
        log.warning("the C++ CPU kernels could not be built, using PyTorch ops instead: %s", e)
        return None
