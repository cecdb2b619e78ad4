"""Measuring batch invariance: how many rows a GEMM must be given so that a row's bits never depend on its batch.

CPU GEMM libraries may take other kernels (other summation orders) for small row counts, and which shapes are
affected depends on the library, the CPU, the dtype and the weight's layout, so it is measured at start rather
than assumed. Used by the linear layers (model/linear.py) and the PyTorch attention path (model/attention.py).
"""

import torch
import torch.nn.functional as F

# The most rows any GEMM is padded to (measured kernels switch below a few rows at most).
MIN_INVARIANT_ROWS = 12


def rows_for_invariance(fn, x: torch.Tensor, max_rows: int = MIN_INVARIANT_ROWS) -> int:
    """The fewest rows a batch must be padded to so that fn (a GEMM over the rows of x) gives every row the
    bits it gets inside the whole batch, alone or in any smaller batch.

    A kernel that differs does so on a few percent of rows, hence every row checked alone.
    """
    ref = fn(x)
    for m in (1, 2, 4, 8):
        if m >= max_rows:
            break
        alone = all(
            torch.equal(fn(F.pad(x[i : i + 1], (0, 0, 0, m - 1)))[:1], ref[i : i + 1]) for i in range(len(x))
        )
        if alone and all(torch.equal(fn(x[:n]), ref[:n]) for n in range(m, max_rows + 1)):
            return m
    return max_rows
