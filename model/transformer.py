"""One decoder-only transformer for every supported architecture (llama, mistral, qwen2, gpt2).

Variation is a few config switches: RMSNorm or LayerNorm, SwiGLU or GELU MLP, RoPE or learned positions,
biases. Tokens arrive flat ([T]): a step's prefill chunks and decodes go through the same code, K/V are
read and written through the slots in AttentionMetadata.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import MIN_INVARIANT_ROWS, AttentionMetadata, paged_attention
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
    """nn.Linear that can pad small batches up to `min_rows` rows (see calibrate_batch_invariance)."""

    min_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n >= self.min_rows:
            return super().forward(x)
        return super().forward(F.pad(x, (0, 0, 0, self.min_rows - n)))[:n]


def linear_rows_are_invariant(weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> bool:
    """Whether F.linear gives a row the same bits alone or in a batch of 2..min_rows-1 rows as it gets at
    any position of a larger batch.

    CPU GEMM libraries pick other kernels (other summation orders) for small row counts, and which shapes
    are affected depends on the library and the CPU, so it is measured rather than assumed. A kernel that
    differs does so on a few percent of rows, hence 64 rows each checked alone.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, weight.shape[1], generator=g).to(weight.device, weight.dtype)
    with torch.inference_mode():
        ref = F.linear(x, weight, bias)
        alone = all(torch.equal(F.linear(x[i : i + 1], weight, bias), ref[i : i + 1]) for i in range(len(x)))
        return alone and all(torch.equal(F.linear(x[:m], weight, bias), ref[:m]) for m in range(2, min_rows))


def calibrate_batch_invariance(model: "Transformer", min_rows: int = MIN_INVARIANT_ROWS) -> int:
    """Make every GEMM give a row the same bits whatever its batch: pad those that need it. Returns how many."""
    verdicts: dict[tuple, bool] = {}
    padded = 0
    for module in [m for m in model.modules() if isinstance(m, Linear)] + [model]:
        weight = model.logits_weight if module is model else module.weight
        bias = None if module is model else module.bias
        key = (tuple(weight.shape), bias is not None)
        if key not in verdicts:
            verdicts[key] = linear_rows_are_invariant(weight, bias, min_rows)
        module.min_rows = 0 if verdicts[key] else min_rows
        padded += not verdicts[key]
    return padded


class Norm(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.hidden_size)) if config.norm == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


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
        return self.o(out.view(T, -1))


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
        x = x + self.attn(self.norm1(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.norm2(x))


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

    min_rows = 0  # the logits GEMM pads smaller batches to this many rows (calibrate_batch_invariance)

    @property
    def logits_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, num_exact: int = 8) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        weight, n = self.logits_weight, hidden.shape[0]
        padded = F.pad(hidden, (0, 0, 0, self.min_rows - n)) if n < self.min_rows else hidden
        logits = F.linear(padded, weight)[:n].float()
        if weight.dtype != torch.float32 and num_exact:
            # 16-bit logits keep ~3 significant digits (steps of 0.125 around 25), so near-ties between
            # the top candidates would be settled by rounding. Recompute those few in float32; the
            # elementwise product + last-dim sum keeps every row independent of its batch.
            top = logits.topk(num_exact, dim=-1).indices  # [N, k]
            exact = (hidden.float()[:, None, :] * weight[top].float()).sum(-1)  # [N, k]
            logits.scatter_(1, top, exact)
        return logits
