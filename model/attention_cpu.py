"""Attention by kvserve's C++ CPU kernel (model/csrc/paged_attention.cpp), the CPU default.

The kernel does one layer's attention for every sequence of a step in one call, reading K/V straight from the
cache through the block tables. Its key tiles are aligned to absolute positions and every sum runs in a fixed
order, so a query gets the same bits in any batch or chunking without padding.
"""

from dataclasses import dataclass

import torch

from model.attention import kernel_tables

# The kernel's unit of work: one KV head of this many queries of one sequence (fewer where a step has few units).
KERNEL_CHUNK = 16


@dataclass
class CpuKernelMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K/V are written
    block_tables: torch.Tensor  # [S, N] int32 of one KV group, padding -> block 0
    seqs: torch.Tensor  # [S, 3] int32: first flat token, query length, sequence length
    block_size: int
    kernel: object  # the compiled paged_attention

    def attend(
        self, q, k, v, k_cache, v_cache, rope, scale: float, window=None, softcap=None, sinks=None
    ) -> torch.Tensor:
        """One call: q and k rotated (rope = (cos, sin) or None), k and v written by slot, attention."""
        cos, sin = rope if rope is not None else (None, None)
        slots = self.slot_mapping if k is not None else None  # none written: a layer reading another's K/V
        # all positional: pybind11 matches keywords by name on every call, ~0.1 ms of a 1-row step over 30 layers
        return self.kernel(
            q, k_cache, v_cache, self.block_tables, self.seqs, self.block_size, scale, window or 0, softcap or 0.0, KERNEL_CHUNK,
            k, v, slots, cos, sin, sinks,
        )  # fmt: skip


class CpuKernelAttention:
    min_query_len = 1  # batch-invariant by construction: no query padding

    def __init__(self, kernels, block_size: int):
        """kernels: the compiled module (model/kernels.py cpu_kernels())."""
        self.kernel = kernels.paged_attention
        self.block_size = block_size

    def build(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[CpuKernelMetadata]]:
        """Flat positions [T] and the step's metadata, one per KV group (see TorchAttention.build); all on the
        CPU, no device copies."""
        positions, seqs, groups = kernel_tables(query_lens, seq_lens, block_tables, self.block_size)
        metas = [
            CpuKernelMetadata(slots, tables, seqs, self.block_size, self.kernel) for slots, tables in groups
        ]
        return positions, metas
