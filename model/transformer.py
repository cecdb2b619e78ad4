"""One decoder-only transformer for every supported architecture (model/families.py).

Variation is config switches: RMSNorm or LayerNorm, where a block's norms sit (before, around or after each
branch), q/k norms, SwiGLU, GeGLU or GELU MLP (or, per layer, sparse experts of them), RoPE per layer (or none, or learned positions), sliding windows
per layer, biases, scalars and soft-caps. Tokens arrive flat ([T]): a step's prefill chunks and decodes go
through the same code, and K/V are written and read through the slots and block tables of the step's attention
metadata (model/attention.py).

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

from model.attention import apply_rope, paged_attention
from model.config import LayerSpec, ModelConfig, Rope
from model.deltanet import DecodeStates, GatedDeltaNet, StepStates
from model.kv_cache import KVCache
from model.layer_stack import build_layer_stack
from model.linear import Linear, PlainLinear
from model.moe import DenseAndMoE, MoE


@dataclass(frozen=True)
class Ops:
    """How the model's ops run, chosen once by whoever builds it."""

    linear: object = field(default_factory=PlainLinear)  # every GEMM's LinearMethod (model/linear.py)
    # (x, residual | None, weight, eps) -> [norm(x + residual), x + residual]: the C++ kernel; None = PyTorch ops
    rms_norm: Callable | None = None
    silu_mul: Callable | None = None  # [gate, up] -> silu(gate) * up: the C++ kernel; None = PyTorch ops
    clamped_swiglu: Callable | None = None  # ([gate, up], alpha, limit) -> GPT-OSS's activation: likewise
    # (loaded model) -> its blocks as one call with the same bits (model/layer_stack.py), or None; None = a loop
    layer_stack: Callable | None = None
    moe: Callable | None = None  # the C++ MoE FFN's constructor (model/moe.py); None = PyTorch ops
    gated_delta_net: Callable | None = None  # a DeltaNet layer's recurrence (model/deltanet.py): likewise
    # without it, whether a DeltaNet layer runs many tokens at once (a GPU's: a step's decodes together, a prompt's
    # tokens in blocks; not batch-invariant) or a token at a time
    parallel_deltanet: bool = False
    # (a sparse layer's experts) -> the GPU's grouped expert GEMMs (model/moe_triton.py) or None; None = PyTorch's
    # loop over experts
    grouped_experts: Callable | None = None
    # a step of DeltaNet decodes' recurrence as one kernel (model/deltanet_triton.py); None = PyTorch ops
    deltanet_decodes: Callable | None = None

    @classmethod
    def with_kernels(cls, linear, kernels) -> "Ops":
        """`linear` GEMMs, and the norm, activation and layer loop of kvserve's C++ CPU kernels
        (model/kernels.py), or PyTorch ops when kernels is None."""
        if kernels is None:
            return cls(linear)
        return cls(
            linear,
            kernels.rms_norm,
            kernels.silu_mul,
            kernels.clamped_swiglu,
            functools.partial(build_layer_stack, kernels=kernels),
            kernels.MoeFfn,
            kernels.gated_delta_net,
        )


def rope_inv_freq(rope: Rope) -> torch.Tensor:
    """[rope.dim / 2] rotary frequencies, scaled as the rope says (linear, or Llama 3's by wavelength); for
    LongRoPE [2, rope.dim / 2]: divided by the short factors, then by the long ones."""
    d = rope.dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = dict(rope.scaling)
    if rope.kind == "longrope":
        return (inv_freq / torch.tensor([rope.short_factor, rope.long_factor], dtype=torch.float64)).float()
    if rope.kind == "linear":
        return (inv_freq / s["factor"]).float()
    if rope.kind == "yarn":
        return yarn_inv_freq(inv_freq, d, rope.theta, s)
    if (
        rope.kind == "proportional"
    ):  # Gemma 4: the first partial_rotary_factor of the pairs turn, the rest stay
        turning = int(s["partial_rotary_factor"] * d // 2)
        return (inv_freq * (torch.arange(d // 2) < turning) / s["factor"]).float()
    if rope.kind != "llama3":
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


def yarn_inv_freq(inv_freq: torch.Tensor, d: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretraining length are divided by
    `factor` (interpolated), those that turn more than beta_fast times are kept, a linear ramp between."""

    def dim_turning(turns: float) -> float:  # the dim whose frequency turns `turns` times over the length
        return (
            d
            * math.log(s["original_max_position_embeddings"] / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dim_turning(s["beta_fast"]), dim_turning(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)).float()


class Norm(nn.Module):
    def __init__(self, size: int, config: ModelConfig, kernel: Callable | None = None):
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if config.norm == "layernorm" else None
        self.kernel = kernel if self.bias is None else None  # RMSNorm only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        if self.kernel is not None:  # rows of any shape: [T, hidden], or [T, heads, head_dim] for q/k norms
            return self.kernel(x.reshape(-1, x.shape[-1]), None, self.weight, self.eps)[0].view(x.shape)
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


class NoNorm:
    """Where a block has no norm before a branch (OLMo 2): the branch reads the residual stream as it is."""

    def add_forward(self, x, residual):
        x = x if residual is None else x + residual
        return x, x


class Attention(nn.Module):
    # the loader keeps this module's own parameters so: its only one is GPT-OSS's sinks (the projections and
    # norms are modules of their own), which the softmax reads in float32
    stored_dtype = torch.float32

    def __init__(self, config: ModelConfig, spec: LayerSpec, ops: Ops):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads, self.head_dim = config.kv_shape(spec)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Qwen3.5: each head's query rows followed by as many rows of its output gate
        self.gated = config.attn_output_gate
        q_rows = 2 * q_size if self.gated else q_size
        # Gemma 4's full layers: no value projection, the keys (before their norm and RoPE) are the values; its last
        # layers: no K/V of their own, they read an earlier layer's (kv_source)
        self.k_eq_v, self.reads_kv = spec.k_eq_v, spec.kv_source >= 0
        kv_rows = 0 if self.reads_kv else kv_size if self.k_eq_v else 2 * kv_size
        self.qkv = Linear(config.hidden_size, q_rows + kv_rows, config.qkv_bias, ops.linear)
        self.o = Linear(q_size, config.hidden_size, config.o_bias, ops.linear)
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.window, self.softcap = spec.window, config.attn_softcap
        # GPT-OSS: [heads] float32 logits that join each query's softmax and take no value
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attn_sinks else None
        self.rotary_dim = spec.rope.dim if spec.rope is not None else 0
        # RMSNorm of q and k before RoPE: per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            per_head = self.qk_norm == "head"
            self.q_norm = Norm(self.head_dim if per_head else q_size, config, ops.rms_norm)
            self.k_norm = (
                None if self.reads_kv else Norm(self.head_dim if per_head else kv_size, config, ops.rms_norm)
            )
        self.v_norm = config.v_norm  # Gemma 4: each value head RMS-normalised, with no weight
        self.norm_kernel = ops.rms_norm  # which runs it where there is one (as the C++ layer loop does)
        self.eps = config.norm_eps

    def forward(self, x, rope, k_cache, v_cache, meta) -> torch.Tensor:
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        gate = None
        if self.gated:
            q_gate, kv = self.qkv(x).split((2 * H * D, 2 * KVH * D), dim=1)
            q, gate = q_gate.view(T, H, 2 * D).chunk(2, dim=-1)
            k, v = kv.view(T, 2 * KVH, D).chunk(2, dim=1)
        elif self.reads_kv:  # queries only: the keys and values are in the cache already
            q, k, v = self.qkv(x).view(T, H, D), None, None
        elif self.k_eq_v:
            q, k = self.qkv(x).view(T, H + KVH, D).split_with_sizes((H, KVH), dim=1)
            v = k
        else:
            q, k, v = self.qkv(x).view(T, H + 2 * KVH, D).split_with_sizes((H, KVH, KVH), dim=1)
        if self.v_norm and v is not None:  # in float32, as the reference, rounded once to v's dtype
            if self.norm_kernel is not None:  # one call (~4 us a decode's row), not F.rms_norm's ops (~22 us)
                v = self.norm_kernel(v.reshape(-1, D), None, None, self.eps)[0].view(v.shape)
            else:
                v = F.rms_norm(v.float(), (D,), eps=self.eps).to(v.dtype)
        if self.reads_kv:
            q = self.q_norm(q) if self.qk_norm == "head" else q
            if rope is not None:  # rotated here: the kernels rotate queries only beside keys they store
                q, rope = apply_rope(q, *rope), None
        elif self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "proj":
            q, k = self.q_norm(q.reshape(T, -1)).view(T, H, D), self.k_norm(k.reshape(T, -1)).view(T, KVH, D)
        if rope is not None and self.rotary_dim < D:  # partial rotary: rotate the first dims here
            q, k = (torch.cat((apply_rope(t[..., : self.rotary_dim], *rope), t[..., self.rotary_dim :]), -1)
                    for t in (q, k))  # fmt: skip
            rope = None
        out = paged_attention(
            q, k, v, k_cache, v_cache, meta, rope, self.scale, self.window, self.softcap, self.sinks
        )
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o(out.reshape(T, -1))

    __call__ = forward  # see Block


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, size: int | None = None, bias: bool | None = None):
        """size, bias: the intermediate size and whether the projections have biases, where not the config's
        (an expert's: model/moe.py)."""
        super().__init__()
        self.kind = config.mlp
        size = size or config.intermediate_size
        bias = config.mlp_bias if bias is None else bias
        n_up = size * (1 if self.kind == "gelu" else 2)
        self.up = Linear(config.hidden_size, n_up, bias, ops.linear)  # gated: [gate; up] fused
        self.down = Linear(size, config.hidden_size, bias, ops.linear)
        self.silu_mul, self.clamped_swiglu = ops.silu_mul, ops.clamped_swiglu
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))

    def activation(self, h: torch.Tensor) -> torch.Tensor:  # [T, n_up] -> [T, intermediate]
        if self.kind == "gelu":
            return F.gelu(h, approximate="tanh")
        if self.kind == "swiglu" and self.silu_mul is not None:
            return self.silu_mul(h)
        if self.kind == "clamped_swiglu" and self.clamped_swiglu is not None:
            return self.clamped_swiglu(h, self.alpha, self.limit)
        gate, up = h.chunk(2, dim=-1)
        if self.kind == "clamped_swiglu":  # GPT-OSS
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")) * up

    __call__ = forward  # see Block


class Block(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec, ops: Ops):
        super().__init__()
        self.rope = spec.rope  # which of the step's rotary tables this layer reads
        norm = functools.partial(Norm, config.hidden_size, config)
        pre, post = config.block in ("pre", "sandwich"), config.block in ("sandwich", "post")
        self.norm1 = norm(ops.rms_norm) if pre else NoNorm()
        # the token mixer, of the layer's kind: attention over the paged KV cache, or Gated DeltaNet's state
        self.linear = spec.mixer == "linear_attention"
        self.attn = GatedDeltaNet(config, ops) if self.linear else Attention(config, spec, ops)
        self.post_attn_norm = norm(ops.rms_norm) if post else None
        self.norm2 = norm(ops.rms_norm) if pre else NoNorm()
        # the FFN, of the layer's kind: dense, sparse experts (model/moe.py), or both side by side (Gemma 4)
        if spec.ffn == "dense_and_moe":
            size = spec.intermediate_size or None
            self.mlp = DenseAndMoE(config, ops, MLP, functools.partial(norm, ops.rms_norm), size)
        elif spec.ffn == "moe":
            self.mlp = MoE(config, ops, MLP)
        else:
            self.mlp = MLP(config, ops, spec.intermediate_size or None)
        self.ffn_reads_stream = spec.ffn == "dense_and_moe"  # its experts and router read the residual stream
        self.post_mlp_norm = norm(ops.rms_norm) if post else None
        self.residual_scale = config.residual_scale
        # Gemma 4: the token's per-layer input gated into the stream, then the stream times a loaded scalar
        self.per_layer_gate = self.per_layer_projection = self.per_layer_norm = None
        if size := config.per_layer_input_size:
            self.per_layer_gate = Linear(config.hidden_size, size, False, ops.linear)
            self.per_layer_projection = Linear(size, config.hidden_size, False, ops.linear)
            self.per_layer_norm = norm(ops.rms_norm)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalar else None

    def forward(
        self, x, residual, rope, k_cache, v_cache, meta, per_layer_input=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the previous block's output, residual: the stream it adds to (None before the first block, or where
        the previous block returned the stream whole). Returns this block's output and the stream it adds to: the
        next norm adds them (one fused pass). per_layer_input: this layer's [T, per_layer_input_size] (Gemma 4)."""
        h, residual = self.norm1.add_forward(x, residual)
        attended = self.branch_out(self.attn(h, rope, k_cache, v_cache, meta), self.post_attn_norm)
        h, residual = self.norm2.add_forward(attended, residual)
        out = self.branch_out(
            self.mlp(h, residual) if self.ffn_reads_stream else self.mlp(h), self.post_mlp_norm
        )
        if self.layer_scalar is None:
            return out, residual
        x = out + residual
        if self.per_layer_gate is not None:
            gated = F.gelu(self.per_layer_gate(x), approximate="tanh") * per_layer_input
            x = x + self.per_layer_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar, None

    def branch_out(self, x: torch.Tensor, post_norm: Norm | None) -> torch.Tensor:
        """What a branch adds to the residual stream: normed after (Gemma, OLMo 2), scaled (Granite)."""
        if post_norm is not None:
            x = post_norm(x)
        return x * self.residual_scale if self.residual_scale != 1.0 else x

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
        self.layers = nn.ModuleList(Block(config, spec, ops) for spec in config.layers)
        self.norm = Norm(config.hidden_size, config, ops.rms_norm)
        # Gemma 4's per-layer embeddings: each token's own [layers x size] row, and a projection of its embedding
        self.per_layer_embed = self.per_layer_projection = self.per_layer_norm = None
        if size := config.per_layer_input_size:
            width = config.num_layers * size
            vocab = config.per_layer_vocab_size
            self.per_layer_embed = Linear(width, vocab, False, ops.linear, rows=True, gemm=False)
            self.per_layer_projection = Linear(config.hidden_size, width, False, ops.linear)
            self.per_layer_norm = Norm(size, config, ops.rms_norm)
        self.inv_freqs: dict[Rope, torch.Tensor] = {}  # each distinct Rope's frequencies (rope_tables_to)
        self._build_layer_stack = ops.layer_stack
        self.layer_stack = None  # the blocks as one call, once the weights are ready

    def rope_tables_to(self, device: torch.device | str) -> None:
        """Computes the rotary frequencies of every Rope the layers use, on `device`."""
        ropes = {spec.rope for spec in self.config.layers} - {None}
        self.inv_freqs = {rope: rope_inv_freq(rope).to(device) for rope in ropes}

    def weights_ready(self) -> None:
        """Called by the loader once every weight is loaded and prepared (packed, quantized)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE | DenseAndMoE):
                layer.mlp.weights_ready()  # its experts as one C++ call, where they are quantized
        if self._build_layer_stack is not None:
            self.layer_stack = self._build_layer_stack(self)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: list,  # the step's attention metadata (model/attention.py), one per KV group of the cache
        kv_cache: KVCache,
        long_rope: torch.Tensor | None = None,  # [T] bool: LongRoPE's long factors for this token's sequence
        # the sequences' state slots, for Gated DeltaNet layers
        states: StepStates | DecodeStates | None = None,
        # [R, 2] int64 runs of rows that are prompt tokens, whose GEMMs run on the weights dequantized to
        # bfloat16 (the layer stack's, on the amx tier: server/engine/backend.py's prompt_gemms)
        prompt_runs: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden], final norm applied
        x = self.embed.rows(input_ids, self.norm.weight.dtype)
        if self.config.embedding_scale != 1.0:  # in the compute dtype, as the reference rounds it
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        ropes = {rope: self.rope(rope, positions, x.dtype, long_rope) for rope in self.inv_freqs}
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer_embed is not None else None
        if self.layer_stack is not None:
            x, residual = self.layer_stack(x, ropes, kv_cache, meta, states, per_layer, prompt_runs)
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                step = states if layer.linear else meta[kv_cache.group_of[i]]
                extra = () if per_layer is None else (per_layer[:, i],)
                x, residual = layer(x, residual, ropes.get(layer.rope), *kv_cache.layer(i), step, *extra)
        return self.norm.add_forward(x, residual)[0]

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's [T, layers, size] per-layer inputs: (norm(projection of the scaled embedding x / sqrt(hidden))
        + the token's own row * sqrt(size)) / sqrt(2), with the reference's roundings."""
        size, dtype = self.config.per_layer_input_size, x.dtype
        own = self.per_layer_embed.rows(input_ids, dtype) * torch.tensor(size**0.5, dtype=dtype)
        projected = self.per_layer_projection(x) * self.config.hidden_size**-0.5
        projected = self.per_layer_norm(projected.view(x.shape[0], -1, size))
        return (projected + own.view_as(projected)) * 2**-0.5

    def rope(
        self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype, long_rope: torch.Tensor | None = None
    ):
        """(cos, cos) and (-sin, sin) of each position's rotary angles, [T, 1, rotary dims] each."""
        inv_freq = self.inv_freqs[rope]
        if rope.kind == "longrope":  # each token's sequence's list: [T, D/2]
            inv_freq = inv_freq[long_rope.long()] if long_rope is not None else inv_freq[0]
        freqs = positions[:, None].float() * inv_freq  # [T, D/2], float32 like the reference
        cos, sin = freqs.cos(), freqs.sin()
        if (scale := dict(rope.scaling).get("attention_factor", 1.0)) != 1.0:  # LongRoPE
            cos, sin = cos * scale, sin * scale
        return torch.cat((cos, cos), -1).to(dtype)[:, None], torch.cat((-sin, sin), -1).to(dtype)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits (divided by Granite's logits_scaling, soft-capped by
        Gemma 2's final_softcap)."""
        logits = self.lm_head.logits(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        if (cap := self.config.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
