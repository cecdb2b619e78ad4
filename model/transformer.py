"""One decoder-only transformer for every supported architecture (llama, mistral, qwen2, gpt2).

Variation is a few config switches: RMSNorm or LayerNorm, SwiGLU or GELU MLP, RoPE or learned positions,
biases. Tokens arrive flat ([T]): a step's prefill chunks and decodes go through the same code, and K/V are
written and read through the slots and block tables of the step's attention metadata (model/attention.py).

How the heavy ops run is given at construction (`Ops`): every GEMM's weight format (model/linear.py), the
RMSNorm and SwiGLU kernels, and whether the blocks run as one C++ call once loaded (model/layer_stack.py, the
same bits as the loop below). Attention runs as the step's metadata says.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import paged_attention
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layer_stack import build_layer_stack
from model.linear import Linear, PlainLinear


@dataclass(frozen=True)
class Ops:
    """How the model's ops run, chosen once by whoever builds it."""

    linear: object = field(default_factory=PlainLinear)  # every GEMM's LinearMethod (model/linear.py)
    # (x, residual | None, weight, eps) -> [norm(x + residual), x + residual]: the C++ kernel; None = PyTorch ops
    rms_norm: Callable | None = None
    silu_mul: Callable | None = None  # [gate, up] -> silu(gate) * up: the C++ kernel; None = PyTorch ops
    # (loaded model) -> its blocks as one call with the same bits (model/layer_stack.py), or None; None = a loop
    layer_stack: Callable | None = None

    @classmethod
    def with_kernels(cls, linear, kernels) -> "Ops":
        """`linear` GEMMs, and the norm, activation and layer loop of kvserve's C++ CPU kernels
        (model/kernels.py), or PyTorch ops when kernels is None."""
        if kernels is None:
            return cls(linear)
        return cls(
            linear, kernels.rms_norm, kernels.silu_mul, functools.partial(build_layer_stack, kernels=kernels)
        )


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


class Norm(nn.Module):
    def __init__(self, config: ModelConfig, kernel: Callable | None = None):
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.hidden_size)) if config.norm == "layernorm" else None
        self.kernel = kernel if self.bias is None else None  # RMSNorm only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        if self.kernel is not None:
            return self.kernel(x, None, self.weight, self.eps)[0]
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)

    __call__ = forward  # without nn.Module's hook machinery, as Linear: see Block

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one pass with the kernel; (norm(x), x) without a residual."""
        if residual is None:
            return self(x), x
        if self.kernel is not None:
            normed, x = self.kernel(x, residual, self.weight, self.eps)
            return normed, x
        x = x + residual
        return self(x), x


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = Linear(config.hidden_size, q_size + 2 * kv_size, config.qkv_bias, ops.linear)
        self.o = Linear(q_size, config.hidden_size, config.out_bias, ops.linear)
        self.scale = self.head_dim**-0.5

    def forward(self, x, rope, k_cache, v_cache, meta) -> torch.Tensor:
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).view(T, H + 2 * KVH, D).split_with_sizes((H, KVH, KVH), dim=1)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, rope, self.scale)
        return self.o(out.reshape(T, -1))

    __call__ = forward  # see Block


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        n_up = 2 * config.intermediate_size if self.swiglu else config.intermediate_size
        self.up = Linear(config.hidden_size, n_up, config.out_bias, ops.linear)  # swiglu: [gate; up] fused
        self.down = Linear(config.intermediate_size, config.hidden_size, config.out_bias, ops.linear)
        self.silu_mul = ops.silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))

    def activation(self, h: torch.Tensor) -> torch.Tensor:  # [T, n_up] -> [T, intermediate]
        if not self.swiglu:
            return F.gelu(h, approximate="tanh")
        if self.silu_mul is not None:
            return self.silu_mul(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    __call__ = forward  # see Block


class Block(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        self.norm1, self.attn = Norm(config, ops.rms_norm), Attention(config, ops)
        self.norm2, self.mlp = Norm(config, ops.rms_norm), MLP(config, ops)

    def forward(self, x, residual, rope, k_cache, v_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's output, residual: the stream it adds to (None before the first block).
        Returns this block's output and the stream it adds to: the next norm adds them (one fused pass)."""
        h, residual = self.norm1.add_forward(x, residual)
        h, residual = self.norm2.add_forward(self.attn(h, rope, k_cache, v_cache, meta), residual)
        return self.mlp(h), residual

    # Called directly, without nn.Module's hook machinery (nothing hooks the model's layers), as Linear is:
    # ~2 us less on each of ~90 calls a step, 2-3% of a lone decode step (measured interleaved, 600 steps each).
    __call__ = forward


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops | None = None):
        super().__init__()
        ops = ops or Ops()
        self.config = config
        # [vocab, hidden] as checkpoints store both: the LM head multiplies, the embedding looks rows up
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, ops.linear, rows=True)
        if config.tie_word_embeddings:  # one matrix, both uses
            self.embed = self.lm_head
        else:
            self.embed = Linear(
                config.hidden_size, config.vocab_size, False, ops.linear, rows=True, gemm=False
            )
        self.pos_embed = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.positions == "learned"
            else None
        )
        self.layers = nn.ModuleList(Block(config, ops) for _ in range(config.num_layers))
        self.norm = Norm(config, ops.rms_norm)
        if config.positions == "rope":
            self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self._build_layer_stack = ops.layer_stack
        self.layer_stack = None  # the blocks as one call, once the weights are ready

    def weights_ready(self) -> None:
        """Called by the loader once every weight is loaded and prepared (packed, quantized)."""
        if self._build_layer_stack is not None:
            self.layer_stack = self._build_layer_stack(self)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta,  # the step's attention metadata (model/attention.py)
        kv_cache: KVCache,
    ) -> torch.Tensor:  # [T, hidden], final norm applied
        x = self.embed.rows(input_ids, self.norm.weight.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = self.rope(positions, x.dtype)
        if self.layer_stack is not None:
            x, residual = self.layer_stack(x, rope, kv_cache, meta)
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, rope, *kv_cache.layer(i), meta)
        return self.norm.add_forward(x, residual)[0]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, cos) and (-sin, sin) of each position's rotary angles, [T, 1, D] each; None without RoPE."""
        if self.pos_embed is not None:
            return None
        freqs = positions[:, None].float() * self.inv_freq  # [T, D/2], float32 like the reference
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        return self.lm_head.logits(hidden)
