"""Where each GGUF block type keeps its float16 fields, for tests that write random blocks, and such blocks."""

import numpy as np

from model.gguf_blocks import BLOCKS

# byte offset in the block -> "d" (a scale) or "m" (a minimum: Q4_1's and Q5_1's m, the K-quants' dmin)
HALVES = {
    "Q4_0": {0: "d"}, "Q4_1": {0: "d", 2: "m"}, "Q5_0": {0: "d"}, "Q5_1": {0: "d", 2: "m"}, "Q8_0": {0: "d"},
    "IQ4_NL": {0: "d"}, "Q4_K": {0: "d", 2: "m"}, "Q5_K": {0: "d", 2: "m"}, "Q6_K": {208: "d"},
    "IQ4_XS": {0: "d"}, "Q3_K": {108: "d"},
}  # fmt: skip
# byte offset in the block of an E8M0 scale (2^(e - 127)): MXFP4's
E8M0 = {"MXFP4": 0}


def random_blocks(type_name: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """uint8 [N, bytes per row]: random bytes, each float16 field a random finite value of sane magnitude (a
    scale of about 2^-12 .. 2^-6 of either sign, as a weight's; a minimum up to ~16 of those; an E8M0 scale
    2^-12 .. 2^-4)."""
    size, nbytes = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (N, K // size, nbytes), dtype=np.uint8)
    for at, what in HALVES.get(type_name, {}).items():
        magnitude = 2.0 ** rng.uniform(-12, -6, (N, K // size)) * (16 if what == "m" else 1)
        value = (magnitude * rng.choice([-1, 1], (N, K // size))).astype(np.float16)
        blocks[..., at : at + 2] = value[..., None].view(np.uint8)
    if type_name in E8M0:
        at = E8M0[type_name]
        blocks[..., at] = rng.integers(127 - 12, 127 - 4, (N, K // size))
    return blocks.reshape(N, -1)


def int16_limit(kernels, qt) -> int:
    """The largest integer a tier rounds float32 activations to where it rounds them to int16 per 32, for the
    QuantizedTensor qt: 32767, or fewer levels where kernels.gemm_int16_narrow says (AMX's one tile product a group
    for 4- and 5-bit q with a minimum)."""
    return kernels.gemm_int16_narrow.get(qt.bits, 32767) if qt.min is not None else 32767
