"""A sparse Mixture-of-Experts FFN (Qwen3-MoE, Qwen2-MoE, OLMoE, Granite MoE, Mixtral): a router scores every
expert for each token, the top k run (each an MLP of its own), and their outputs are summed, weighted by
the router's probabilities. ../shared/MODELS.md §5.1 lists each family's router.

Each expert is an ordinary MLP, two Linear layers, so its weights run in whatever format the model's LinearMethod
gives them (quantized, packed, padded for batch invariance: model/linear.py), and a GGUF's 3-D expert tensors
arrive as one 2-D slice per expert, read in place. A step's tokens are grouped by expert: each chosen expert's
weights are read once, however many tokens chose it. On a GPU the dense experts of a layer run as two grouped
Triton GEMMs instead, the grouping done on the device (model/moe_triton.py); on a CPU with quantized experts, one
C++ call (model/csrc/moe.cpp).
"""

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.invariance import rows_for_invariance
from model.linear import padded


class Gate(nn.Module):
    """[T, hidden] -> [T, n] float32 scores, whatever the model's dtype: the router (n = experts) and the shared
    expert's gate (n = 1). llama.cpp keeps both float32 in every quantized file; a near-tie between two experts
    is then settled by the scores, not by rounding. On CPU a small batch is padded to the rows that give each
    token its bits in any batch (measured once loaded, as model/linear.py does for the other GEMMs): a token's
    experts and their weights never depend on what shares its step."""

    stored_dtype = torch.float32  # the loader keeps this module's weight so (model/loader.py)

    def __init__(self, n: int, hidden: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, hidden))
        self.bias = nn.Parameter(torch.empty(n)) if bias else None  # GPT-OSS's router
        self.min_rows = 1

    # measured once per shape (every layer's router has the same): (experts, hidden, bias) -> rows
    _min_rows: dict[tuple, int] = {}

    def weights_ready(self) -> None:
        if self.weight.device.type == "cpu" and len(self.weight) > 1:
            key = (*self.weight.shape, self.bias is not None)
            if key not in Gate._min_rows:
                x = torch.randn(64, self.weight.shape[1], generator=torch.Generator().manual_seed(0))
                with torch.inference_mode():
                    Gate._min_rows[key] = rows_for_invariance(self._scores, x)
            self.min_rows = Gate._min_rows[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded(x.float(), self.min_rows, self._scores)

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.weight) == 1:  # a GEMV's sums may depend on the rows it is given; a row's own sum cannot
            return (x * self.weight[0]).sum(-1, keepdim=True)
        return F.linear(x, self.weight, self.bias)

    __call__ = forward  # see model/transformer.py's Block


def token_sigmoid(scores: torch.Tensor) -> torch.Tensor:
    """sigmoid of each token's one score [T, 1], the same bits whatever T. torch's elementwise loops hand a
    tensor's last few elements to scalar code whose exp differs from the vector code's in the last bit, so which
    tokens those are would depend on the step; spread over 64 columns (a multiple of every CPU tier's loop step),
    every token's score runs in the vector code."""
    return torch.sigmoid(scores.expand(-1, 64).contiguous())[:, :1]


class MoE(nn.Module):
    """The FFN of a sparse layer: sum over a token's k experts of weight * expert(x), plus a shared expert scaled
    by sigmoid(shared_gate . x) where the family has one (Qwen2-MoE).

    A token's sum runs over its experts in ascending id whatever else is in the step, and each expert's GEMM
    gives a row the same bits in any batch (the LinearMethod's promise), so a token's output never depends on
    its batch: greedy decoding is the same alone and batched, and speculation stays exact."""

    def __init__(self, config: ModelConfig, ops, mlp):
        """mlp(config, ops, size): the dense MLP (model/transformer.py), which each expert is, of its own size."""
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        self.router = Gate(moe.num_experts, hidden, moe.bias)
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        # Gemma 4: the router's input scale [hidden] and each expert's weight's scale [experts]
        self.scaled_router = moe.scaled_router
        self.router_scale = nn.Parameter(torch.ones(hidden)) if moe.scaled_router else None
        self.expert_scale = nn.Parameter(torch.ones(moe.num_experts)) if moe.scaled_router else None
        self.eps, self.norm_kernel = config.norm_eps, ops.rms_norm
        self.experts = nn.ModuleList(
            mlp(config, ops, moe.intermediate_size, moe.bias) for _ in range(moe.num_experts)
        )
        self.shared = mlp(config, ops, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_gate = Gate(1, hidden) if moe.shared_intermediate_size else None
        # the C++ MoE FFN's constructor, or None; it runs SwiGLU experts (clamped or not) and GeGLU ones, with biases
        # or not, behind the plain routers and Gemma 4's
        self.fused_ffn = ops.moe if config.mlp in ("swiglu", "clamped_swiglu", "geglu") else None
        self.gelu = config.mlp == "geglu"
        self.alpha, self.limit = (
            (config.swiglu_alpha, config.swiglu_limit) if config.mlp == "clamped_swiglu" else (1.0, 0.0)
        )
        self.fused = None  # this FFN as one C++ call (weights_ready), where every expert is quantized
        # the GPU's grouped experts (model/moe_triton.py), dense or quantized on the device
        self.grouped_ffn, self.grouped = ops.grouped_experts, None

    def weights_ready(self) -> None:
        """Once loaded: the whole FFN as one C++ call (model/csrc/moe.cpp: the same routing and sums, the step's
        tokens grouped by expert in C++) where the kernels run and every expert's weights are quantized."""
        for gate in (self.router, self.shared_gate):
            if gate is not None:
                gate.weights_ready()
        mlps = [*self.experts, *([self.shared] if self.shared is not None else [])]
        linears = [linear for mlp in mlps for linear in (mlp.up, mlp.down)]
        if self.grouped_ffn is not None:
            self.grouped = self.grouped_ffn(self.experts)
        if self.fused_ffn is None or any(getattr(linear, "bits", None) is None for linear in linears):
            return
        shared = (self.shared.up.gemm, self.shared.down.gemm, self.shared_gate.weight) if self.shared else ()
        scales = {}
        if self.scaled_router:
            scales = dict(router_scale=self.router_scale, expert_scale=self.expert_scale.float())
        self.fused = self.fused_ffn(
            self.router.weight, [e.up.gemm for e in self.experts], [e.down.gemm for e in self.experts],
            self.top_k, self.renormalize, *shared, router_bias=self.router.bias, swiglu_alpha=self.alpha,
            swiglu_limit=self.limit, gelu=self.gelu, eps=self.eps, **scales,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; router_input: what the router reads where not x (Gemma 4's: the residual
        stream, where the experts read its norm)."""
        if self.fused is not None:
            return self.fused(x, router_input)
        weights, ids = self.route(x if router_input is None else router_input)
        if self.grouped is not None:
            return self._with_shared(x, self.grouped(x, weights, ids))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # (expert, token) pairs sorted by expert: each used expert runs once on all of its tokens
        order = ids.flatten().argsort(stable=True)
        experts, counts = ids.flatten()[order].unique_consecutive(return_counts=True)
        tokens = order // ids.shape[1]
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            rows = tokens[start : start + count]
            y = self.experts[expert](x[rows]).float() * weights.flatten()[order[start : start + count], None]
            out[rows] += y  # a token takes an expert once: no row repeats (index_add_ is ~1,000x slower here
            # under torch's deterministic mode)
            start += count
        return self._with_shared(x, out)

    def _with_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum `out` (float32) plus the shared expert where there is one, in x's dtype."""
        if self.shared is not None:
            out += token_sigmoid(self.shared_gate(x)) * self.shared(x).float()
        return out.to(x.dtype)

    __call__ = forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top k experts: ([T, k] float32 weights, [T, k] ids). Softmax over every expert, then
        top k; renormalized, the k weights are the softmax over the chosen k (Mixtral, Granite's softmax of
        the top k logits, Qwen3-MoE's norm_topk_prob)."""
        if self.scaled_router:  # Gemma 4's: rms_norm(x) * scale / sqrt(hidden), in x's dtype as the reference
            if self.norm_kernel is not None:  # as model/csrc/moe.cpp: one call, rounded once to x's dtype
                x = self.norm_kernel(x, None, None, self.eps)[0]
            else:
                x = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)
            x = x * self.router_scale * x.shape[-1] ** -0.5
        probs = torch.softmax(self.router(x), dim=-1)  # [T, experts]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaled_router:
            weights = weights * self.expert_scale.float()[ids]
        return weights, ids


class DenseAndMoE(nn.Module):
    """Gemma 4 26B-A4B's FFN: the dense MLP on the block's normed stream, and beside it sparse experts on the stream
    normed apart, routed by the stream itself; each branch normed after, then summed (the block norms the sum)."""

    def __init__(self, config: ModelConfig, ops, mlp, norm, size: int | None = None):
        """mlp(config, ops, size): the dense MLP, of the layer's size where not the model's; norm(): an RMSNorm of
        the hidden size (model/transformer.py's)."""
        super().__init__()
        self.dense, self.dense_norm = mlp(config, ops, size), norm()
        self.moe = MoE(config, ops, mlp)
        self.moe_in_norm, self.moe_norm = norm(), norm()
        self.top_k = self.moe.top_k

    def weights_ready(self) -> None:
        self.moe.weights_ready()

    @property
    def experts(self) -> nn.ModuleList:
        return self.moe.experts

    def forward(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """x: the block's normed stream (the dense MLP's input); stream: the residual stream."""
        dense = self.dense_norm(self.dense(x))
        return dense + self.moe_norm(self.moe(self.moe_in_norm(stream), stream))

    __call__ = forward
