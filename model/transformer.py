"""One decoder-only transformer for every supported architecture (llama, mistral, qwen2, gpt2).

Variation is a few config switches: RMSNorm or LayerNorm, SwiGLU or GELU MLP, RoPE or learned positions,
biases. Tokens arrive flat ([T]): a step's prefill chunks and decodes go through the same code, K/V are
read and written through the slots in AttentionMetadata.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionMetadata, paged_attention, rows_for_invariance
from model.config import ModelConfig
from model.kv_cache import KVCache


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] rotary frequencies, with Llama 3 scaling when the config asks for it."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = config.rope_scaling_dict
    if not s:
        return inv_freq.float()
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = old_len / s["low_freq_factor"]
    high_wavelen = old_len / s["high_freq_factor"]
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    blended = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(medium, blended, scaled).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] in Hugging Face's half-split layout; cos [T, 1, D] = (cos, cos), sin = (-sin, sin).

    Equals (x1 cos - x2 sin, x2 cos + x1 sin) bit for bit: rolling by D/2 swaps the halves.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Linear(nn.Linear):
    """nn.Linear that can run on a pre-packed weight (pack_weights) and pad small batches up to `min_rows`
    rows (calibrate_batch_invariance)."""

    min_rows = 1
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm(x, self.weight, self.bias, self.packed, self.min_rows)


def gemm(x, weight, bias=None, packed=None, min_rows=1) -> torch.Tensor:
    """x @ weight.T + bias, through oneDNN's packed copy of the weight when there is one."""
    n = x.shape[0]
    rows = max(n, min_rows)
    if packed is not None:
        rows = row_bucket(rows)
    if rows > n:
        x = F.pad(x, (0, 0, 0, rows - n))
    if packed is None:
        y = F.linear(x, weight, bias)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y if rows == n else y[:n]


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


def pack_weights(model: "Transformer") -> bool:
    """Give every GEMM a copy of its weight in oneDNN's blocked layout (CPU, bfloat16 or float32).

    torch's plain CPU GEMM reorders the weight on every call; packed once, a single decode row's GEMMs run
    in ~60% of the time (SmolLM2-135M, bf16, 2 cores: 10.7 ms vs 18.2 ms per token, measured). The plain
    weights of the blocks are then dropped (meta tensors) so the model is not held twice; the embedding
    stays, as lookups and the float32 logit recompute read its rows. Returns False where oneDNN cannot.
    """
    dtype = model.embed.weight.dtype
    if not (model.embed.weight.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    with torch.inference_mode():
        try:
            model.logits_packed = torch.ops.mkldnn._reorder_linear_weight(model.logits_weight, 1)
        except RuntimeError:
            return False
        for module in model.layers.modules():
            if isinstance(module, Linear):
                module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight, 1)
                module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
    return True


def calibrate_batch_invariance(model: "Transformer") -> int:
    """Make every GEMM of the model give a row the same bits whatever its batch: pad those that need it.
    Returns how many GEMMs pad."""
    found: dict[tuple, int] = {}
    g = torch.Generator().manual_seed(0)
    w = model.embed.weight
    for module in [m for m in model.layers.modules() if isinstance(m, Linear)] + [model]:
        if module is model:
            key, fn, in_features = ("logits",), model.logits_gemm, model.config.hidden_size
        else:
            key, fn, in_features = (
                (module.in_features, module.out_features, module.bias is not None),
                module,
                module.in_features,
            )
        module.min_rows = 1
        if key not in found:
            x = torch.randn(64, in_features, generator=g).to(w.device, w.dtype)
            with torch.inference_mode():
                found[key] = rows_for_invariance(fn, x)
        module.min_rows = found[key]
    return sum(m.min_rows > 1 for m in model.modules() if isinstance(m, Linear)) + (model.min_rows > 1)


class Norm(nn.Module):
    kernels = None  # the C++ CPU kernels (model/kernels.py) where the runner enables them: RMSNorm in one op

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.hidden_size)) if config.norm == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        if self.kernels is not None:
            return self.kernels.rms_norm(x, None, self.weight, self.eps)[0]
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one pass with the C++ kernel."""
        if self.bias is None and self.kernels is not None:
            normed, x = self.kernels.rms_norm(x, residual, self.weight, self.eps)
            return normed, x
        x = x + residual
        return self(x), x


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o = Linear(q_size, config.hidden_size, bias=config.out_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x, rope, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)
        if rope is not None:  # q and k rotated in one go
            qk = apply_rope(qk, *rope)
        q, k = qk.split((H, KVH), dim=1)
        v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        n_up = 2 * config.intermediate_size if self.swiglu else config.intermediate_size
        self.up = Linear(config.hidden_size, n_up, bias=config.out_bias)  # swiglu: [gate; up] fused
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=config.out_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(h, approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm1, self.attn = Norm(config), Attention(config)
        self.norm2, self.mlp = Norm(config), MLP(config)

    def forward(self, x, rope, k_cache, v_cache, meta) -> torch.Tensor:
        h, x = self.norm2.add_forward(x, self.attn(self.norm1(x), rope, k_cache, v_cache, meta))
        return x + self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_embed = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.positions == "learned"
            else None
        )
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = Norm(config)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False)
        )
        if config.positions == "rope":
            self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [T, hidden], final norm applied
        x = self.embed(input_ids)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            freqs = positions[:, None].float() * self.inv_freq  # [T, D/2], float32 like the reference
            cos, sin = freqs.cos(), freqs.sin()
            rope = (
                torch.cat((cos, cos), -1).to(x.dtype)[:, None],
                torch.cat((-sin, sin), -1).to(x.dtype)[:, None],
            )
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, *kv_cache.layer(i), meta)
        return self.norm(x)

    def use_cpu_kernels(self, kernels) -> None:
        """RMSNorm through the C++ kernels (model/kernels.py), or through PyTorch ops with None."""
        for module in self.modules():
            if isinstance(module, Norm):
                module.kernels = kernels

    min_rows = 1  # the logits GEMM pads smaller batches to this many rows (calibrate_batch_invariance)
    logits_packed: torch.Tensor | None = None  # see pack_weights

    @property
    def logits_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits_gemm(self, hidden: torch.Tensor) -> torch.Tensor:
        return gemm(hidden, self.logits_weight, None, self.logits_packed, self.min_rows)

    def compute_logits(self, hidden: torch.Tensor, num_exact: int = 8) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        logits = self.logits_gemm(hidden).float()
        weight = self.logits_weight
        if weight.dtype != torch.float32 and num_exact:
            # 16-bit logits keep ~3 significant digits (steps of 0.125 around 25), so near-ties between
            # the top candidates would be settled by rounding. Recompute those few in float32; the
            # elementwise product + last-dim sum keeps every row independent of its batch.
            top = logits.topk(num_exact, dim=-1).indices  # [N, k]
            exact = (hidden.float()[:, None, :] * weight[top].float()).sum(-1)  # [N, k]
            logits.scatter_(1, top, exact)
        return logits
