"""GGUF's quantized blocks, read into kvserve's QuantizedTensor (model/quant.py) without changing a value.

`from_gguf_blocks(type_name, blocks, shape)` takes a tensor's rows as the file holds them (uint8 [N, bytes per
row], each row its blocks along K, as read from a GGUF or stored by weights/gguf_convert.py) and returns the
exact integers and scales, in the form the kernels multiply (quant_gemm.cpp): 4 to 6 bits as in the file (Q4_0,
Q4_1, Q4_K; Q5_0, Q5_1, Q5_K; Q6_K, whose q - 32 becomes q with a minimum; IQ4_NL, IQ4_XS, MXFP4, whose q
indexes their levels), a byte each for Q8_0. The layouts are ggml-common.h's (MODELS.md 3.1); gguf-py's
`gguf.quants.dequantize` gives the same values (tests/model/test_gguf_blocks.py).
"""

import torch

from model.quant import MXFP4_LEVELS, QuantizedTensor

# type name -> (weights per block, bytes per block)
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "IQ4_NL": (32, 18),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}


class NotExactError(ValueError):
    """The blocks hold a value the kernels' form cannot hold exactly (the caller dequantizes them instead)."""


def from_gguf_blocks(type_name: str, blocks: torch.Tensor, shape: tuple[int, int]) -> QuantizedTensor:
    """A GGUF tensor of `shape` [N, K] in `type_name` (GGML's name: Q4_K, Q6_K, ...) from its raw block bytes."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF type {type_name} is not kept quantized: one of {', '.join(BLOCKS)}")
    N, K = shape
    size, nbytes = BLOCKS[type_name]
    if K % size or blocks.numel() != N * K // size * nbytes:
        raise ValueError(f"{type_name} blocks of {blocks.numel()} bytes do not make a [{N}, {K}] weight")
    b = blocks.reshape(N, K // size, nbytes)
    return _PARSERS[type_name](b, N, K)


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block: [N, blocks]."""
    return b[..., at : at + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 8n] of 0 or 1: bit i % 8 of byte i // 8 (a little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., None] >> shifts) & 1).flatten(-2)


def _q4_0(b, N, K):  # d, qs[16]: w = d (q - 8) = d q + (-8 d), exact in float16 unless it overflows
    d = _half(b, 0)
    return QuantizedTensor(4, _nibbles(b[..., 2:18]).reshape(N, K), d, (-8 * d.float()).half(), kind="Q4_0")


def _q4_1(b, N, K):  # d, m, qs[16]: w = d q + m
    return QuantizedTensor(4, _nibbles(b[..., 4:20]).reshape(N, K), _half(b, 0), _half(b, 2), kind="Q4_1")


def _q5(b, N, K, with_min: bool):  # d[, m], qh[4] (bit 4 of each q), qs[16]
    at = 4 if with_min else 2
    q = (_nibbles(b[..., at + 4 : at + 20]) | (_bits(b[..., at : at + 4]) << 4)).reshape(N, K)  # 0..31
    d = _half(b, 0)
    if with_min:  # Q5_1: w = d q + m
        return QuantizedTensor(5, q, d, _half(b, 2), kind="Q5_1")
    # Q5_0: w = d (q - 16) = d q + (-16 d), exact (-16 d in float16 unless it overflows; d q + (-16 d) in float32)
    return QuantizedTensor(5, q, d, (-16 * d.float()).half(), kind="Q5_0")


def _q8_0(b, N, K):  # d, int8 qs[32]
    return QuantizedTensor(
        8, b[..., 2:34].contiguous().view(torch.int8).reshape(N, K), _half(b, 0), kind="Q8_0"
    )


def _iq4_nl(b, N, K):  # d, qs[16] (nibbles as Q4_0's): w = d levels[q], q kept (4 bits without a minimum)
    return QuantizedTensor(4, _nibbles(b[..., 2:18]).reshape(N, K), _half(b, 0), kind="IQ4_NL")


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums -> [N, blocks, 8] each (get_scale_min_k4)."""
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc.view(torch.int8), m.view(torch.int8)  # 0..63


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """The K-quants' 128 bytes of nibbles -> [N, blocks, 8, 32]: chunk c of 32 bytes holds sub-block 2c in its
    low nibbles and 2c + 1 in its high ones."""
    chunks = qs.unflatten(-1, (4, 32))
    return torch.stack([chunks & 15, chunks >> 4], dim=-2).flatten(-3, -2)


def _q4_k(b, N, K):  # d, dmin, scales[12], qs[128]: w = d sc q - dmin m
    sc, m = _k_scales(b[..., 4:16])
    q = _k_low(b[..., 16:144]).reshape(N, K)
    return QuantizedTensor(4, q, sc.reshape(N, -1), m.reshape(N, -1), _half(b, 0), -_half(b, 2), kind="Q4_K")


def _q5_k(b, N, K):  # d, dmin, scales[12], qh[32] (bit j of byte l: q[32 j + l]'s bit 4), qs[128]
    sc, m = _k_scales(b[..., 4:16])
    high = (b[..., 16:48, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [N, blocks, 32 l, 8 j]
    q = (_k_low(b[..., 48:176]) | (high.transpose(-1, -2) << 4)).reshape(N, K)
    return QuantizedTensor(5, q, sc.reshape(N, -1), m.reshape(N, -1), _half(b, 0), -_half(b, 2), kind="Q5_K")


def _q6_k(b, N, K):  # ql[128], qh[64], int8 scales[16], d: w = d sc (q - 32) = (d sc) q + (-32 d) sc, per 16
    ql = b[..., 0:128].unflatten(-1, (2, 64))  # per half of 128: 64 bytes
    qh = b[..., 128:192].unflatten(-1, (2, 32))  # per half: 32 bytes
    low = torch.cat([ql & 15, ql >> 4], dim=-1)  # [N, blocks, 2, 128]: 4 quarters of 32
    high = (qh[..., None, :] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # [.., 2, 4, 32]
    q = (low | (high.flatten(-2) << 4)).reshape(N, K)  # 0..63
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(N, -1)
    d = _half(b, 208)
    # the minimum's sub-scale is the scale's own (one tensor: no bytes more), its super-block's -32 d, and
    # (d sc) q + (-32 d) sc is d sc (q - 32) exactly in float32 (24 significant bits at most). The kernels take
    # m as -32 d (model/csrc/quant_gemm.h, Q6_K_GROUP): a d whose -32 d is no float16 is dequantized instead
    if d.numel() and d.float().abs().max() * 32 > torch.finfo(torch.float16).max:
        raise NotExactError(f"Q6_K scales up to {d.float().abs().max():.0f}: -32 d is no float16")
    return QuantizedTensor(6, q, sc, sc, d, (-32 * d.float()).half(), group=16, kind="Q6_K")


def _mxfp4(b, N, K):  # e (E8M0), qs[16] (nibbles as Q4_0's): w = 2^(e - 127) e2m1[q] = 2^(e - 128) levels[q]
    e = b[..., 0].int()
    # the kernels keep a group's scale as float16: 2^(e - 128) is one where e - 128 is in -24 .. 15 (a subnormal
    # below -14); real checkpoints' scales sit near 2^-7 (GPT-OSS's), far inside
    if e.numel() and (e.min() < 128 - 24 or e.max() > 128 + 15):
        raise NotExactError(
            f"MXFP4 scales 2^{e.min() - 127} .. 2^{e.max() - 127} are not all float16 numbers"
        )
    d = torch.ldexp(torch.ones(e.shape), (e - 128).float()).half()
    q = _nibbles(b[..., 1:17]).reshape(N, K)
    return QuantizedTensor(4, q, d, kind="MXFP4", levels=MXFP4_LEVELS)


def _iq4_xs(b, N, K):  # d, u16 scales_h, scales_l[4], qs[128]: w = d (ls - 32) levels[q] per 32
    high = (_half(b, 2).view(torch.int16).int()[..., None] >> torch.arange(0, 16, 2)) & 3  # [N, blocks, 8]
    low = b[..., 4:8]
    low = torch.stack([low & 15, low >> 4], dim=-1).flatten(-2).int()  # [N, blocks, 8]
    ls = ((low | (high << 4)) - 32).to(torch.int8)
    q = _nibbles(b[..., 8:136].unflatten(-1, (8, 16)))  # [N, blocks, 8, 32]: level indices
    return QuantizedTensor(4, q.reshape(N, K), ls.reshape(N, -1), supers=_half(b, 0), kind="IQ4_XS")


_PARSERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": lambda b, N, K: _q5(b, N, K, with_min=False),
    "Q5_1": lambda b, N, K: _q5(b, N, K, with_min=True),
    "Q8_0": _q8_0,
    "IQ4_NL": _iq4_nl,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
}


def gguf_weight(
    type_name: str, blocks: torch.Tensor, shape: tuple[int, int]
) -> QuantizedTensor | torch.Tensor:
    """A GGUF weight as a QuantizedTensor where a kernel keeps its type, else dequantized to float32 [N, K] by
    the gguf package (the caller logs what that cost)."""
    if type_name in BLOCKS:
        try:
            return from_gguf_blocks(type_name, blocks, shape)
        except NotExactError:
            pass
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = dequantize(blocks.numpy(), GGMLQuantizationType[type_name])
    except (KeyError, NotImplementedError):
        raise ValueError(f"GGML type {type_name} can be neither kept quantized nor dequantized") from None
    return torch.from_numpy(values.astype("float32", copy=False)).reshape(shape)
