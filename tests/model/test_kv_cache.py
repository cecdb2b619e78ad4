import os
import sys

import pytest
import torch

from model.kv_cache import zeroed_pool

MiB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the process's resident memory from /proc"
)
def test_a_cpu_pool_is_held_only_where_it_is_written():
    before = resident_bytes()
    pool = zeroed_pool((4, 2, 32768, 1024), torch.bfloat16, "cpu")  # 512 MiB: [rows, heads, slots, head_dim]
    assert pool.shape == (4, 2, 32768, 1024) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert resident_bytes() - before < 64 * MiB
    # every slot reads as zero (a masked key must not be NaN), and reading it holds nothing
    assert all(
        pool[r, h, s].abs().max().item() == 0 for r in range(4) for h in range(2) for s in (0, 20000, 32767)
    )
    assert resident_bytes() - before < 64 * MiB
    # writing 16 slots of every row and head (one block) holds about those pages, nothing near the pool
    pool[:, :, 16:32] = 1.5
    assert resident_bytes() - before < 64 * MiB
    assert pool[:, :, 16:32].eq(1.5).all() and pool[:, :, 32].abs().max().item() == 0
    # writing it all holds it all
    pool.fill_(2.0)
    assert resident_bytes() - before > 448 * MiB
    del pool


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_pool_is_zeros_of_its_shape_and_dtype_on_every_device_path(dtype):
    pool = zeroed_pool((3, 5, 7), dtype, "cpu")
    assert pool.shape == (3, 5, 7) and pool.dtype == dtype
    assert pool.float().abs().max().item() == 0
    pool[1, 2, 3] = 1.0
    assert pool.float().sum().item() == 1.0
    assert zeroed_pool((0, 4), dtype, "cpu").shape == (0, 4)
    meta = zeroed_pool((3, 5, 7), dtype, "meta")
    assert meta.device.type == "meta" and meta.shape == (3, 5, 7)
