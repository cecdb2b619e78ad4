"""The CPU tier kvserve runs as, chosen once at start: the instructions its C++ kernels are compiled for and the
numbers each tier computes in.

A tier's numbers are what its CPU multiplies natively. With AVX-512 BF16 a bfloat16 pair product is one
instruction, so activations and dense weights are bfloat16 there. Everywhere else bfloat16 arithmetic is a
conversion around float32 arithmetic: those tiers compute in float32. The quantized GEMMs multiply the file's
exact integers: by activations rounded to int8 per group of 32, as llama.cpp does, where the tier has a byte
product (AVX512-VNNI's vpdpbusd, four a lane; AVX2's vpmaddubsw, two: quant_gemm_i8.cpp), else (and with
--gemm-activations wide) by the tier's own: bfloat16 pairs (quant_gemm_bf16.cpp), int16 per group of 32
(vpmaddwd; quant_gemm_i16.cpp) or float32 (baseline). With AMX (Intel Xeons since Sapphire Rapids) a tile of
16 x 16 x 64 int8 products is one instruction: there a GEMM of many rows runs on tiles, each int16 activation as
two bytes, with the same integer sums as the vectors that run a decode step's few rows (quant_gemm_amx.cpp), so
its bits are the avx512 tier's.
The KV cache is bfloat16 on every tier: storage only, read once per step per token, whose conversion to
float32 is a shift, and half the bytes float32 would cost (attention at 32 streams is bound by them). A
request's bits may differ between tiers (other instructions, other sums) but never within one.

`select("auto")` takes the best tier that both the CPU (its /proc/cpuinfo flags) and torch's own dispatch
(ATEN_CPU_CAPABILITY) allow; a tier named outright (--cpu-tier, KVSERVE_CPU_TIER) must be one the CPU has. With
torch's ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA set to the tier's `aten` and `onednn` as well, a
whole process computes as it would on that tier's CPU.
"""

import ctypes
import platform
from dataclasses import dataclass
from functools import cache

import torch

_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
_AVX2 = ("avx2", "fma", "f16c")


@dataclass(frozen=True)
class CpuTier:
    name: str
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    cflags: tuple[str, ...]  # the C++ kernels' compiler flags for these instructions
    dtype: torch.dtype  # activations and dense weights
    kv_dtype: torch.dtype  # the KV cache: bfloat16 everywhere (a step reads it all; to float32 is a shift)
    aten: str  # torch's ATEN_CPU_CAPABILITY for the same instructions
    onednn: str  # oneDNN's ONEDNN_MAX_CPU_ISA for the same instructions
    summary: str  # what is native, for the start-up log and the README
    tiles: bool = False  # AMX: runs only where Linux grants the process the tile state (amx_granted)

    def runs_on(self, flags: frozenset[str]) -> bool:
        return set(self.needs) <= flags and (not self.tiles or amx_granted())


def _m(flags: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("-m" + f.replace("_", "") for f in flags)


# Best first.
TIERS = (
    # float32 activations as int16, as the avx512 tier's: bfloat16 activations (the avx512bf16 tier's) lost top-1
    # agreement with float32 (kvserve bench-quality: 97.9% on the default model)
    CpuTier(
        "amx",
        # every CPU with AMX has AVX512-VNNI (Sapphire Rapids on): one instruction a pair of int16 products
        (*_AVX512, "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16", *_AVX2),
        (*_m((*_AVX512, "avx512_bf16", "avx512_vnni", *_AVX2)), "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
        torch.float32,
        torch.bfloat16,
        "avx512",
        "AVX512_CORE_AMX",
        "AMX tiles: float32 activations (int16 in the quantized GEMMs, whose many rows run on int8 tiles); "
        "bfloat16 KV cache",
        tiles=True,
    ),
    CpuTier(
        "avx512bf16",
        (*_AVX512, "avx512_bf16", "avx512_vnni", *_AVX2),
        _m((*_AVX512, "avx512_bf16", "avx512_vnni", *_AVX2)),
        torch.bfloat16,
        torch.bfloat16,
        "avx512",
        "AVX512_CORE_BF16",
        "AVX-512 with bfloat16 pair products (and VNNI): bfloat16 activations and KV cache",
    ),
    CpuTier(
        "avx512",
        (*_AVX512, *_AVX2),
        _m((*_AVX512, *_AVX2)),
        torch.float32,
        torch.bfloat16,
        "avx512",
        "AVX512_CORE",
        "AVX-512, no bfloat16 arithmetic: float32 activations (int16 in the quantized GEMMs), bfloat16 KV cache",
    ),
    CpuTier(
        "avx2",
        _AVX2,
        _m(_AVX2),
        torch.float32,
        torch.bfloat16,
        "avx2",
        "AVX2",
        "AVX2 + FMA, no bfloat16 arithmetic: float32 activations, bfloat16 KV cache",
    ),
    # any CPU: the kernels' vector code compiled for the platform's baseline (SSE2 on x86-64, NEON on arm64)
    CpuTier(
        "generic",
        (),
        (),
        torch.float32,
        torch.bfloat16,
        "default",
        "ALL",
        "baseline vectors: float32 activations, bfloat16 KV cache",
    ),
)
BY_NAME = {t.name: t for t in TIERS}
_ATEN_RANK = {"avx512": 2, "avx2": 1, "default": 0}  # how far torch's own kernels go


def platform_tiers() -> tuple[CpuTier, ...]:
    """Every tier a compiler can target on this platform, whatever this CPU runs (x86-64: all of them)."""
    return TIERS if _x86() else (BY_NAME["generic"],)


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo, x86 only; empty elsewhere: the generic tier)."""
    if not _x86():
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def amx_granted() -> bool:
    """Whether Linux grants this process AMX's tile state (8 KiB a thread, handed out only on request:
    arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). Asked once; the grant covers every thread."""
    if platform.system() != "Linux" or not _x86():
        return False
    sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(sys_arch_prctl, req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


def torch_capability() -> str:
    """torch's own dispatch level as ATEN_CPU_CAPABILITY names it: avx512, avx2 or default."""
    level = torch.backends.cpu.get_cpu_capability().lower()
    return level if level in _ATEN_RANK else "default"


def runnable(flags: frozenset[str] | None = None) -> list[CpuTier]:
    """Every tier this CPU can execute, best first (an AVX-512 host runs avx2 and generic too)."""
    flags = cpu_flags() if flags is None else flags
    return [t for t in TIERS if t.runs_on(flags)]


def emulated(flags: frozenset[str] | None = None) -> list[CpuTier]:
    """The tiers whose tiles this CPU lacks but whose other instructions it has: their modules load here, and
    their tile kernels run on a software model of the tiles (model/csrc/amx.h), for the tests."""
    flags = cpu_flags() if flags is None else flags
    have = runnable(flags)
    return [
        t
        for t in TIERS
        if t.tiles and t not in have and {f for f in t.needs if not f.startswith("amx_")} <= flags
    ]


def select(name: str = "auto") -> tuple[CpuTier, str]:
    """The tier to run as and why, for the log: `auto` is the best the CPU and torch's dispatch allow."""
    flags, capability = cpu_flags(), torch_capability()
    have = runnable(flags)
    if name == "auto":
        capped = [t for t in have if _ATEN_RANK[t.aten] <= _ATEN_RANK[capability]]
        tier = capped[0]
        why = f"the best this CPU runs ({have[0].name})"
        if tier is not have[0]:
            why += f", capped by torch's ATEN_CPU_CAPABILITY={capability}"
        refused = [t.name for t in TIERS if set(t.needs) <= flags and t not in have]
        if refused:
            why += f"; {', '.join(refused)}: Linux refused this process the tile state"
        return tier, why
    if name not in BY_NAME:
        raise ValueError(f"unknown CPU tier {name!r}: use auto or one of {', '.join(BY_NAME)}")
    tier = BY_NAME[name]
    if tier not in have:
        missing = (
            ", ".join(f for f in tier.needs if f not in flags) or "the tile state, which Linux refused it"
        )
        raise ValueError(
            f"CPU tier {name!r} needs {missing}, which this CPU lacks; it runs {', '.join(t.name for t in have)}"
        )
    why = "asked for"
    if tier.aten != capability:
        why += (
            f"; torch's own ops still dispatch at {capability}: set ATEN_CPU_CAPABILITY={tier.aten} and "
            f"ONEDNN_MAX_CPU_ISA={tier.onednn} too to compute as on that CPU"
        )
    return tier, why
