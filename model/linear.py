"""How a linear layer runs: the seam a weight format plugs into.

The model builds every GEMM as `Linear(in, out, bias, method)`. Its LinearMethod, chosen once by whoever builds
the model, says how the weight is stored and multiplied:
- PlainLinear: F.linear on the checkpoint's weight (GPUs, and CPUs without oneDNN);
- OneDnnLinear: the weight packed once into oneDNN's blocked layout (CPU).
Both can pad small batches so that a row's bits never depend on its batch (measured per weight shape).
After the weights are loaded the loader calls `method.prepare(layer)` once (pack, measure); every call then runs
`method.apply(layer, x)`. A quantized format is one more method.
"""

import torch
import torch.nn.functional as F
from torch import nn

from model import invariance


class Linear(nn.Module):
    """y = x W^T + b, computed as its method says. `weight` is [out, in], as checkpoints store it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method, keeps_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method = method
        self.keeps_weight = keeps_weight  # its rows are read elsewhere (the LM head's exact logits)
        self.min_rows = 1  # batches smaller than this are padded (set by the method's prepare)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        return self.method.apply(self, x)


def padded(x: torch.Tensor, rows: int, gemm) -> torch.Tensor:
    """gemm(x) computed on x padded with zero rows up to `rows`, cut back to x's rows."""
    n = x.shape[0]
    if rows <= n:
        return gemm(x)
    return gemm(F.pad(x, (0, 0, 0, rows - n)))[:n]


class PlainLinear:
    """F.linear on the weight as loaded. batch_invariant: pad the small batches of the GEMMs that need it."""

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant
        self._min_rows: dict[tuple, int] = {}  # measured once per (in, out, bias, dtype)

    def prepare(self, layer: Linear) -> None:
        layer.min_rows = self._measure(layer) if self.batch_invariant else 1

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return padded(x, layer.min_rows, lambda x: F.linear(x, layer.weight, layer.bias))

    def _measure(self, layer: Linear) -> int:
        w = layer.weight
        key = (layer.in_features, layer.out_features, layer.bias is not None, w.dtype)
        if key not in self._min_rows:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(64, layer.in_features, generator=g).to(w.device, w.dtype)
            layer.min_rows = 1
            with torch.inference_mode():
                self._min_rows[key] = invariance.rows_for_invariance(lambda x: self.apply(layer, x), x)
        return self._min_rows[key]


class OneDnnLinear(PlainLinear):
    """CPU GEMMs on weights packed once into oneDNN's blocked layout (bfloat16 or float32).

    torch's plain CPU GEMM reorders the weight on every call; packed once, a single decode row's GEMMs run in
    ~60% of the time (SmolLM2-135M, bf16, 2 cores: 10.7 ms vs 18.2 ms per token, measured). The plain weight
    is then dropped (a meta tensor) so the model is not held twice, unless the layer keeps it.
    """

    @staticmethod
    def available(dtype: torch.dtype, device: torch.device) -> bool:
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            return False
        if not torch.backends.mkldnn.is_available():
            return False
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        except RuntimeError:
            return False
        return True

    def prepare(self, layer: Linear) -> None:
        with torch.inference_mode():
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight, 1)
        super().prepare(layer)
        if not layer.keeps_weight:
            layer.weight = nn.Parameter(layer.weight.to("meta"), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = row_bucket(max(x.shape[0], layer.min_rows))
        return padded(
            x, rows, lambda x: torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        )


def row_bucket(n: int) -> int:
    """n rounded up to one of four steps per power of two (1..8, 10, 12, 14, 16, 20, ..., 448, 512, ...).

    oneDNN keeps memory for every GEMM shape it has run (~0.25 MiB each, never returned: a server's RSS
    grew by 600 MiB over 800 requests of mixed lengths). Padding the rows to these buckets bounds the shapes
    to ~32 per weight up to 512 rows, for at most 25% extra rows, which are near free at decode sizes.
    """
    if n <= 8:
        return n
    step = 1 << (n - 1).bit_length() - 3
    return -(-n // step) * step
