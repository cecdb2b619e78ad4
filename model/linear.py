"""How a linear layer runs: the seam a weight format plugs into.

The model builds every weight matrix as `Linear(in, out, bias, method)`: the GEMMs, and the embedding (whose
rows are looked up). Its LinearMethod, chosen once by whoever builds the model, says how the weight is stored
and multiplied:
- PlainLinear: F.linear on the checkpoint's weight (GPUs, and CPUs without oneDNN);
- OneDnnLinear: the weight packed once into oneDNN's blocked layout (CPU);
- QuantizedLinear (model/quant.py): 4- and 8-bit weights, kept quantized, by kvserve's C++ kernel.
The first two can pad small batches so that a row's bits never depend on its batch (measured per weight
shape). After the weights are loaded the loader calls `method.prepare(layer)` once (pack, quantize, measure);
then `apply` runs every GEMM, `rows` looks rows up, `logits` gives float32 scores.
"""

import torch
import torch.nn.functional as F
from torch import nn

from model import invariance


class Linear(nn.Module):
    """y = x W^T + b, computed as its method says. `weight` is [out, in], as checkpoints store it."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, method, rows: bool = False, gemm: bool = True
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method = method
        self.reads_rows, self.runs_gemm = rows, gemm  # what the model does with it: look rows up, multiply
        self.min_rows = 1  # batches smaller than this are padded (set by the method's prepare)
        self.quantized = None  # a checkpoint's quantized weight (model/quant.py), until prepare() packs it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.method.apply(self, x)

    # Called directly, without nn.Module's hook machinery (nothing hooks a Linear): ~1.5 us less on each of a
    # step's 121 GEMMs, 3% of a lone decode step.
    __call__ = forward

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T] -> [T, in]
        return self.method.rows(self, ids).to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out] float32
        return self.method.logits(self, x)


def padded(x: torch.Tensor, rows: int, gemm) -> torch.Tensor:
    """gemm(x) computed on x padded with zero rows up to `rows`, cut back to x's rows."""
    n = x.shape[0]
    if rows <= n:
        return gemm(x)
    return gemm(F.pad(x, (0, 0, 0, rows - n)))[:n]


class PlainLinear:
    """F.linear on the weight as loaded. batch_invariant: pad the small batches of the GEMMs that need it."""

    keeps_quantized = False  # a checkpoint's quantized weights come dequantized

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant
        self._min_rows: dict[tuple, int] = {}  # measured once per (in, out, bias, dtype)

    def prepare(self, layer: Linear) -> None:
        layer.min_rows = self._measure(layer) if self.batch_invariant and layer.runs_gemm else 1

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return padded(x, layer.min_rows, lambda x: F.linear(x, layer.weight, layer.bias))

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def logits(self, layer: Linear, x: torch.Tensor, num_exact: int = 8) -> torch.Tensor:
        logits = self.apply(layer, x).float()
        if layer.weight.dtype != torch.float32 and num_exact:
            # 16-bit logits keep ~3 significant digits (steps of 0.125 around 25), so near-ties between
            # the top candidates would be settled by rounding. Recompute those few in float32; the
            # elementwise product + last-dim sum keeps every row independent of its batch.
            top = logits.topk(num_exact, dim=-1).indices  # [T, k]
            exact = (x.float()[:, None, :] * layer.weight[top].float()).sum(-1)  # [T, k]
            logits.scatter_(1, top, exact)
        return logits

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
    is then dropped (a meta tensor) so the model is not held twice, unless its rows are read (the tied
    embedding, the exact logits).
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
        if not layer.runs_gemm:  # an embedding only: its rows as they are
            return super().prepare(layer)
        with torch.inference_mode():
            layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight, 1)
        super().prepare(layer)
        if not layer.reads_rows:
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
