"""model/huge_pages.py: which 2 MiB frames are asked for, and that moving them keeps every value."""

import sys
from pathlib import Path

import pytest
import torch

from model.huge_pages import HUGE_PAGE, frames_to_move, on_huge_pages

MiB = 1 << 20


def test_a_frame_is_moved_when_the_tensors_fill_half_of_it():
    base = 100 * HUGE_PAGE
    # one tensor over frames 100-102 whose last quarter of frame 102 is someone else's
    assert frames_to_move({(base, 2 * HUGE_PAGE + 3 * MiB // 2)}) == [100, 101, 102]
    # a tensor ending a quarter into a frame leaves that frame alone
    assert frames_to_move({(base, HUGE_PAGE + MiB // 2)}) == [100]
    # small neighbours (an MoE layer's experts) fill a frame together
    experts = {(base + i * 600 * 1024, 600 * 1024) for i in range(4)}
    assert frames_to_move(experts) == [100]
    # one small tensor alone does not move a frame; an empty one counts for nothing
    assert frames_to_move({(base + 5, 64 * 1024), (base + 3 * HUGE_PAGE, 0)}) == []


def anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps."""
    total, overlapping = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlapping = lo < end and start < hi
        elif head == "AnonHugePages:" and overlapping:
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_moving_keeps_the_values_and_what_it_says_it_moved_is_on_huge_pages():
    weights = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.float32)  # 6 MiB
    before = weights.clone()
    # what else a model holds is passed over: a weight dropped to the meta device, oneDNN's packed weight
    packed = (
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64), 1)
        if torch.backends.mkldnn.is_available()
        else None
    )
    others = [torch.empty(4, device="meta"), *([packed] if packed is not None else [])]
    moved = on_huge_pages([weights, *others])
    assert torch.equal(weights, before)
    start = weights.data_ptr()
    assert moved % HUGE_PAGE == 0 and moved <= len(frames_to_move({(start, 6 * MiB)})) * HUGE_PAGE
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and "[never]" in mode.read_text():
        assert moved == 0
    assert anon_huge_bytes(start, start + 6 * MiB) >= moved


def mapped(start: int, end: int) -> bool:
    """Whether any mapping of this process overlaps [start, end)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < end and start < hi:
            return True
    return False


def skip_without_huge_pages() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel gives no transparent huge pages")


@pytest.fixture
def packing_kernels():
    """The compiled kernels' pack_quant, where Linux gives transparent huge pages."""
    skip_without_huge_pages()
    from model.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    return kernels


def test_packed_weights_are_written_onto_huge_pages(packing_kernels):
    """model/csrc/quant_pack.cpp writes a packed weight into memory of its own (not the allocator's, which may
    hand out memory already written on 4 KiB pages), from a 2 MiB boundary, with 2 MiB pages asked for first: its
    whole frames are on them from the start, and the memory goes back to the system with the tensor."""
    size = 12 * MiB
    q = torch.randint(0, 16, (8192, 3072), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = packing_kernels.pack_quant(q, 4, 32)
    start, end = packed.data_ptr(), packed.data_ptr() + packed.nbytes
    assert packed.nbytes == size and start % HUGE_PAGE == 0
    # Linux grants a 2 MiB page at fault time where it has one free: most, not all
    assert anon_huge_bytes(start, end) >= size // HUGE_PAGE // 2 * HUGE_PAGE
    del packed
    assert not mapped(start, end)


def test_weights_under_a_frame_are_carved_side_by_side_from_regions_on_huge_pages(packing_kernels):
    """A packed weight of less than 2 MiB (an MoE layer's expert) is carved from a region shared with the ones
    packed before it, mapped like a big weight's: the experts' frames are on 2 MiB pages from their first write,
    and a region goes back to the system with the last weight carved from it."""
    q = torch.randint(0, 16, (1024, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    # 0.5 MiB each: 300 MiB, over 256 MiB regions
    experts = [packing_kernels.pack_quant(q, 4, 32) for _ in range(600)]
    starts = [e.data_ptr() for e in experts]
    assert all(e.nbytes == MiB // 2 for e in experts) and all(torch.equal(e, experts[0]) for e in experts)
    # one after the other; where one does not follow the last, a region of its own began (the first may share
    # the region of weights packed before: a model of another test)
    fresh = [b for a, b in zip(starts, starts[1:], strict=False) if b - a != MiB // 2]
    assert 1 <= len(fresh) <= 2 and all(b % HUGE_PAGE == 0 for b in fresh)
    total = len(experts) * MiB // 2
    # Linux grants a 2 MiB page at fault time where it has one free: most, not all
    assert anon_huge_bytes(min(starts), max(starts) + MiB // 2) >= total // HUGE_PAGE // 2 * HUGE_PAGE
    del experts
    assert not any(mapped(b, b + MiB // 2) for b in fresh)


@pytest.mark.parametrize("bits", [4, 6])
def test_a_weight_packed_into_memory_of_its_own_holds_the_same_bytes(bits):
    """Packing is per tile of 16 rows: a weight over 2 MiB (its own mapping, a partial last frame) packs into the
    bytes of its halves (each under 2 MiB: carved from a shared region) one after the other."""
    from model.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    group = 16 if bits == 6 else 32
    q = torch.randint(
        0, 1 << bits, (4112, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    whole = kernels.pack_quant(q, bits, group)
    assert whole.nbytes > HUGE_PAGE
    halves = [kernels.pack_quant(q[:2048], bits, group), kernels.pack_quant(q[2048:], bits, group)]
    assert all(h.nbytes < HUGE_PAGE for h in halves)
    assert torch.equal(whole, torch.cat(halves))
