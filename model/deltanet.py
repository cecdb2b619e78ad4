"""Gated DeltaNet (Qwen3.5, Qwen3-Next: ../shared/MODELS.md §5.3): linear attention whose memory of a sequence is a
fixed-size state, read and written at every token, instead of K/V that grow with it.

Per value head, with S a key_head_dim x value_head_dim float32 matrix, for each token:
    S <- S * exp(g);   S <- S + k (beta (v - S^T k))^T;   o = S^T q / sqrt(key_head_dim)
where q, k, v come out of a causal depthwise convolution (conv_kernel taps, SiLU) over the input projection, q and k
are L2-normalized (each key head serves a group of value heads), beta = sigmoid(b) and g = -exp(A_log) softplus(a +
dt_bias). The output is RMS-normed per head, times silu(z), then projected back.

S is computed in chunks of CHUNK tokens, aligned to the sequence's positions: a head keeps S0, S after the
sequence's last multiple of CHUNK tokens, and a row [k | u | G] for each token since, u = beta (v - S^T k) its
correction and G its log decay summed from the chunk's start. For token p of a chunk, S_p^T x = exp(G_p) S0^T x
+ sum_{j<=p} exp(G_p - G_j) (k_j . x) u_j; the chunk's last token folds the rows into S0. That is the recurrence
unrolled (transformers' torch_chunk_gated_delta_rule computes the same), and a product with S0 for all of a
chunk's tokens at once in place of two passes over S a token: model/csrc/deltanet.cpp's speed on a prompt. Every
number is a function of the sequence's tokens and positions alone, so a prompt gives the same bits prefilled in
one step, in chunks of any size or a token at a time, and a state restored from a snapshot (the prefix cache) or
kept after a draft (speculative decoding) goes on as computed.

Each sequence keeps its last conv_kernel - 1 convolution inputs and its heads' S0 and rows in a state slot of the
cache (model/kv_cache.py); the step's `StepStates` says which tokens are whose, where each sequence stands and
which slot it has. Here the tokens go one at a time, and every op that is not a plain product or sum runs on one
token's values: torch's elementwise loops hand a tensor's last few elements to scalar code whose exp differs from
the vector code's in the last bit, so which elements those are must not depend on the step. Where kvserve's C++
kernels run, model/csrc/deltanet.cpp does the same between the two projections (each sequence and value head in
parallel), inside the fused layer loop (model/layer_stack.py) where the GEMMs are quantized. On a GPU, which
promises no batch invariance, a step's decodes run all at once instead (`_decodes`), and its prompt chunks all
together in blocks of BLOCK positions, the blocks' corrections solved together and only the state passed from
block to block (`_prompts`).
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.device import to_device
from model.linear import Linear

# A chunk's tokens. Each head's state holds dk + dv + 1 floats for each token since S0 (an eighth more than S at
# dk = dv = 128, in the cache's budget), and the work on them grows with the chunk, while S0's products gain
# nothing past a few rows (a CPU has no matrix units to feed): at 16, the state took a quarter more and a decode
# step of 32 sequences ran slower than at 8 (model/csrc/deltanet.cpp, Zen 4, both tiers)
CHUNK = 8
# positions a block of a sequence's tokens spans from a chunk's start, where its corrections are solved at once (a
# GPU's prompts: _prompts); a multiple of CHUNK
BLOCK = 64
# blocks (of all the step's prompts together) _prompts solves at once: at Qwen3-Next's 32 value heads of 128 x 128,
# ~130 MB of states at the blocks' starts and ~35 MB for each [.., L, L] product
SEQUENCE_BLOCKS = 64


def state_width(key_head_dim: int, value_head_dim: int) -> int:
    """Floats a value head's state takes: S0, then the chunk's keys, corrections and log decays."""
    return key_head_dim * value_head_dim + CHUNK * (key_head_dim + value_head_dim + 1)


def split_state(state: torch.Tensor, key_head_dim: int, value_head_dim: int):
    """A sequence's heads' states [Hv, state_width] as views: S0 [Hv, dk, dv], the chunk's keys as columns
    [Hv, dk, CHUNK], their corrections [Hv, CHUNK, dv] and log decays [Hv, CHUNK] (model/csrc/deltanet.cpp's
    layout, which reads a token's dot products with every key as one vector)."""
    dk, dv = key_head_dim, value_head_dim
    S0, keys, corrections, log_decays = state.split((dk * dv, dk * CHUNK, CHUNK * dv, CHUNK), dim=-1)
    return S0.view(-1, dk, dv), keys.view(-1, dk, CHUNK), corrections.view(-1, CHUNK, dv), log_decays


@dataclass
class StepStates:
    """The step's sequences as the DeltaNet layers see them, in the step's flat token order."""

    starts: list[int]  # flat index of each sequence's first token this step
    lengths: list[int]  # its tokens this step
    slots: list[int]  # its state slot in the cache
    positions: list[int]  # its tokens before this step (0: its state starts from zero)
    # -1, or the first of length - 1 slots that get its state after each of its tokens but the last (a decode
    # verifying drafts: the engine goes back to the state after the last token it keeps)
    keep_each: list[int] | None = None

    def __post_init__(self):
        if self.keep_each is None:
            self.keep_each = [-1] * len(self.starts)

    @functools.cached_property
    def decodes(self) -> list[int]:
        """The sequences that decode a token, keeping no state after it (no drafts): a GPU runs them together."""
        return [
            i
            for i, (n, keep) in enumerate(zip(self.lengths, self.keep_each, strict=True))
            if n == 1 and keep < 0
        ]

    @property
    def decodes_only(self) -> bool:
        return len(self.decodes) == len(self.starts)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' (slots, positions) as [D] int64 tensors on the device: copied once a step, read by every
        layer (with their rows in the step: decode_rows)."""
        return self._on_device(device)[1:]

    def decode_rows(self, device: torch.device) -> torch.Tensor:
        """[D] int64 on the device: each decode's row in the step's tokens."""
        return self._on_device(device)[0]

    def _on_device(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if getattr(self, "_device", None) != device:
            columns = ([self.starts[i] for i in self.decodes], [self.slots[i] for i in self.decodes],
                       [self.positions[i] for i in self.decodes])  # fmt: skip
            self._device, self._tensors = device, to_device(torch.tensor(columns), device).unbind(0)
        return self._tensors

    def prompts(self, conv_kernel: int, device: torch.device) -> "PromptLayout":
        """Where a GPU reads and writes the step's prompt chunks (every sequence but the decodes and those that
        keep states after their tokens): built once a step, read by every layer."""
        if getattr(self, "_prompts_on", None) != device:
            chosen = set(self.decodes)
            chunks = [
                (start, n, slot, position)
                for i, (start, n, slot, position, keep) in enumerate(
                    zip(self.starts, self.lengths, self.slots, self.positions, self.keep_each, strict=True)
                )
                if i not in chosen and keep < 0
            ]
            self._prompts_on, self._prompts = device, PromptLayout.of(chunks, conv_kernel, device)
        return self._prompts

    @functools.cached_property
    def table(self) -> torch.Tensor:
        """[N, 5] int64 (start, length, slot, position, keep_each) for the C++ kernel: made once a step, read by
        every layer."""
        columns = (self.starts, self.lengths, self.slots, self.positions, self.keep_each)
        return torch.tensor(list(zip(*columns, strict=True)))


@dataclass
class DecodeStates:
    """A step of decodes whose state slots and positions are on the device already: a CUDA graph's inputs
    (server/engine/decode_graphs.py), read as StepStates.on gives them."""

    slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    decodes_only = True

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots, self.positions


@dataclass
class PromptLayout:
    """A step's prompt chunks as a GPU runs them together (GatedDeltaNet._prompts), sequences longest first: their
    tokens in the step's order ("prompt tokens"), and each sequence's rows in blocks of BLOCK positions from its
    chunk's start, row r at position - position % CHUNK + r. Index tensors on the device; `blocks` on the host."""

    rows: torch.Tensor  # [Tp] each prompt token's row in the step
    # [kernel, Tp] each token's convolution inputs, tap by tap, as rows of (the prompt tokens' inputs, then each
    # sequence's kept kernel - 1); [B, kernel - 1] the inputs each sequence keeps after the step, the same way
    taps: torch.Tensor
    kept: torch.Tensor
    tokens: torch.Tensor  # [B, blocks x BLOCK] the prompt token at each row of a sequence, Tp where none
    slots: torch.Tensor  # [B]
    fresh: torch.Tensor  # [B] bool: no tokens before (its state starts from zero)
    held: torch.Tensor  # [B] rows its state holds since its chunk's start (position % CHUNK)
    ends: torch.Tensor  # [B] its rows: held + its tokens this step
    blocks: list[int]  # sequences with rows in each block: a prefix, longest first

    @staticmethod
    def of(chunks: list[tuple[int, int, int, int]], conv_kernel: int, device: torch.device) -> "PromptLayout":
        """chunks: (start in the step, tokens, state slot, position) of each sequence."""
        chunks = sorted(chunks, key=lambda c: -(c[3] % CHUNK + c[1]))
        start, n, slot, position = torch.tensor(chunks, dtype=torch.int64).reshape(-1, 4).T
        B, Tp, K1 = len(chunks), int(n.sum()), conv_kernel - 1
        held = position % CHUNK
        ends = held + n
        width = -(-int(ends.max()) // BLOCK) * BLOCK if B else 0
        offset = n.cumsum(0) - n  # each sequence's first prompt token
        seq = torch.repeat_interleave(torch.arange(B), n)  # [Tp]
        t = torch.arange(Tp) - offset[seq]  # a token's place in its sequence's chunk

        # input t of a sequence's (t < 0: the ones it kept)
        def source(seq: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.where(t >= 0, offset[seq] + t, Tp + seq * K1 + K1 + t)

        taps = torch.stack([source(seq, t - K1 + j) for j in range(conv_kernel)])
        each = torch.arange(B)[:, None]
        kept = source(each, n[:, None] - K1 + torch.arange(K1))
        r = torch.arange(width)
        tokens = torch.where(
            (r >= held[:, None]) & (r < ends[:, None]), offset[:, None] + r - held[:, None], Tp
        )
        blocks = [int((ends > b * BLOCK).sum()) for b in range(width // BLOCK)]
        parts = (
            start[seq] + t,
            taps.flatten(),
            kept.flatten(),
            tokens.flatten(),
            slot,
            position == 0,
            held,
            ends,
        )
        sizes = [len(x) for x in parts]
        on = to_device(torch.cat([x.long() for x in parts]), device).split(sizes)
        rows, taps, kept, tokens, slots, fresh, held, ends = on
        return PromptLayout(
            rows, taps.view(conv_kernel, Tp), kept.view(B, K1), tokens.view(B, width), slots, fresh.bool(), held,
            ends, blocks,
        )  # fmt: skip


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    # this module's own parameters (convolution, decay, gated norm) stay float32, as the recurrence computes
    stored_dtype = torch.float32

    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        spec = self.spec = config.linear_attention
        self.eps = config.norm_eps
        # [q, k, v] for the convolution, z (the output gate), b (beta) and a (the decay's step), fused
        sizes = (spec.conv_dim, spec.value_dim, spec.num_value_heads, spec.num_value_heads)
        self.sizes = sizes
        self.in_proj = Linear(config.hidden_size, sum(sizes), False, ops.linear)
        self.conv = nn.Parameter(torch.zeros(spec.conv_dim, 1, spec.conv_kernel))
        self.A_log = nn.Parameter(torch.zeros(spec.num_value_heads))
        self.dt_bias = nn.Parameter(torch.ones(spec.num_value_heads))
        self.gated_norm = nn.Parameter(torch.ones(spec.value_head_dim))  # a plain weight: x * w, not 1 + w
        self.out = Linear(spec.value_dim, config.hidden_size, False, ops.linear)
        # the C++ recurrence (model/csrc/deltanet.cpp), or None: the loop below
        self.kernel = ops.gated_delta_net
        # a GPU's: a step's decodes as one (_decodes), its prompts in blocks (_prompts), not a token at a time
        self.parallel = ops.parallel_deltanet
        # _decodes's recurrence in one kernel (model/deltanet_triton.py), or None: PyTorch ops
        self.decodes_kernel = ops.deltanet_decodes

    def forward(self, x, rope, conv_state, recurrent_state, states: StepStates) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; conv_state [slots, conv_kernel - 1, conv_dim] and recurrent_state
        [slots, value heads, state_width] (float32) are this layer's, updated in place. `rope` is
        unused: DeltaNet has no positions."""
        return self.out(self.mix(self.in_proj(x), conv_state, recurrent_state, states))

    def mix(self, proj, conv_state, recurrent_state, states: StepStates) -> torch.Tensor:
        """What runs between the two projections: the input projection [T, sum(sizes)] through the convolution,
        the delta rule and the gated norm -> [T, value_dim]."""
        spec, T = self.spec, proj.shape[0]
        if self.kernel is not None:
            conv = self.conv.view(spec.conv_dim, spec.conv_kernel)
            return self.kernel(proj.contiguous(), conv, self.A_log, self.dt_bias, self.gated_norm, conv_state,
                               recurrent_state, states.table, spec.num_key_heads, spec.key_head_dim,
                               spec.value_head_dim, self.eps, spec.tiled_value_heads)  # fmt: skip
        if self.parallel and states.decodes_only:
            return self._decodes(proj, conv_state, recurrent_state, *states.on(proj.device))
        out = torch.empty(T, spec.value_dim, dtype=proj.dtype, device=proj.device)
        # a GPU's mixed step: its decodes together, as in a step of decodes; its prompts together
        if self.parallel:
            if states.decodes:
                rows = states.decode_rows(proj.device)
                out[rows] = self._decodes(proj[rows], conv_state, recurrent_state, *states.on(proj.device))
            prompts = states.prompts(spec.conv_kernel, proj.device)
            if prompts.blocks:
                out[prompts.rows] = self._prompts(proj, conv_state, recurrent_state, prompts)
        sequences = zip(
            states.starts, states.lengths, states.slots, states.positions, states.keep_each, strict=True
        )
        for start, n, slot, position, keep_each in sequences:
            # every sequence on the CPU; on a GPU the decodes that keep their drafts' states
            if not self.parallel or keep_each >= 0:
                rows = slice(start, start + n)
                out[rows] = self._tokens(proj[rows], conv_state, recurrent_state, slot, position, keep_each)
        return out

    def _tokens(
        self, proj, conv_state, recurrent_state, slot: int, position: int, keep_each: int
    ) -> torch.Tensor:
        """One sequence's n tokens (proj [n, sum(sizes)], its first at `position`) a token at a time: every op on
        one token's values, in shapes its position alone sets; from slot keep_each on (>= 0), its state after each
        token but the last. -> [n, value_dim]"""
        spec, n = self.spec, proj.shape[0]
        qkv, z, b, a = proj.split(self.sizes, dim=-1)
        decay_rate = -self.A_log.exp()
        convolved = self._convolve(qkv.float(), conv_state, slot, position == 0, keep_each)
        state = recurrent_state[slot].clone()
        if position == 0:
            state[:, : spec.key_head_dim * spec.value_head_dim] = 0
        out = torch.empty(n, spec.value_dim, dtype=proj.dtype, device=proj.device)
        for t in range(n):
            beta = b[t].sigmoid().float()  # [Hv]
            log_decay = decay_rate * F.softplus(a[t].float() + self.dt_bias)
            o = self._delta_rule(convolved[t], beta, log_decay, state, (position + t) % CHUNK)
            out[t] = self._gated_norm(o.to(proj.dtype), z[t]).reshape(-1)
            if keep_each >= 0 and t + 1 < n:
                recurrent_state[keep_each + t] = state
        recurrent_state[slot] = state
        return out

    __call__ = forward  # see model/transformer.py's Block

    def _decodes(self, proj, conv_state, recurrent_state, slots, positions) -> torch.Tensor:
        """A step of B decodes all at once: the loop's arithmetic (_convolve, _delta_rule) on [B, ...] tensors, each
        sequence's place in its chunk (position % CHUNK) read on the device, rows it has not reached masked. A
        step is then the same few dozen kernels however many sequences it holds (its recurrence one, where a GPU's
        Triton kernel runs it: model/deltanet_triton.py), where the loop launches that many for each; its sums
        run in other orders than the loop's, so a token's bits may depend on its batch (a GPU promises no batch
        invariance). slots, positions: [B] int64 on proj's device."""
        spec, B = self.spec, proj.shape[0]
        dk, dv, Hv = spec.key_head_dim, spec.value_head_dim, spec.num_value_heads
        qkv, z, b, a = proj.split(self.sizes, dim=-1)
        fresh, m = positions == 0, positions % CHUNK  # [B]
        # the convolution over each sequence's kept inputs (none when fresh) and its token
        past = torch.where(fresh[:, None, None], 0.0, conv_state[slots])
        window = torch.cat((past, qkv.float()[:, None]), 1)  # [B, kernel, conv_dim]
        conv_state[slots] = window[:, 1:]
        q, k, v = self._heads((window * self.conv[:, 0].T).sum(1))  # [B, Hv, dk], [B, Hv, dk], [B, Hv, dv]
        beta, log_decay = self._gates(b, a)  # [B, Hv]
        if self.decodes_kernel is not None:  # the states read and written in place
            out = self.decodes_kernel(q, k, v, beta, log_decay, recurrent_state, slots, positions)
            return self._gated_norm(out.to(proj.dtype), z).reshape(B, spec.value_dim)
        state = recurrent_state[slots]  # [B, Hv, state_width], a copy written back below
        S0, keys, corrections, log_decays = (
            t.view(B, Hv, *t.shape[1:]) for t in split_state(state.view(B * Hv, -1), dk, dv)
        )
        S0.masked_fill_(fresh[:, None, None, None], 0.0)
        at = m[:, None, None].expand(B, Hv, 1)
        previous = log_decays.gather(-1, (at - 1).clamp(min=0)).squeeze(-1)
        G = log_decay + torch.where(m[:, None] > 0, previous, 0.0)  # [B, Hv]: log decay since the chunk began
        decay = G.exp()
        keys.scatter_(-1, at[..., None].expand(B, Hv, dk, 1), k[..., None])
        log_decays.scatter_(-1, at, G[..., None])
        rows = torch.arange(CHUNK, device=proj.device)
        weights = (G[..., None] - log_decays).exp()  # [B, Hv, CHUNK]: exp(G_p - G_j), rows up to this token's
        weights = torch.where(rows <= m[:, None, None], weights, 0.0)

        def read(x, upto: torch.Tensor) -> torch.Tensor:  # S^T x: S0's part, then the chunk's rows j < upto
            # rows not yet written in this chunk hold older values: left out
            reached = (rows < upto[:, None])[:, None, :, None]
            dots = (keys * x[..., None]).sum(2) * weights  # [B, Hv, CHUNK]
            from_rows = torch.where(reached, dots[..., None] * corrections, 0.0).sum(2)
            return decay[..., None] * (S0 * x[..., None]).sum(2) + from_rows

        recall = read(k, m)  # [B, Hv, dv]
        correction = (v - recall) * beta[..., None]
        corrections.scatter_(2, at[..., None].expand(B, Hv, 1, dv), correction[:, :, None])
        out = read(q, m + 1)
        # a chunk's last token folds its rows into S0: S0 <- exp(G) S0 + sum_j exp(G - G_j) k_j u_j^T
        folded = S0 * decay[..., None, None] + (keys * weights[:, :, None]) @ corrections
        S0.copy_(torch.where((m == CHUNK - 1)[:, None, None, None], folded, S0))
        recurrent_state[slots] = state
        return self._gated_norm(out.to(proj.dtype), z).reshape(B, spec.value_dim)

    def _prompts(self, proj, conv_state, recurrent_state, layout: PromptLayout) -> torch.Tensor:
        """The step's prompt chunks together (layout: where each reads and writes), in blocks of BLOCK positions
        from each sequence's chunk start. For a block's new tokens t,
            u_t + beta_t sum_{j<t} exp(G_t - G_j) (k_t . k_j) u_j = beta_t (v_t - exp(G_t) S^T k_t),
        a unit lower-triangular system over the block's rows (the rows the state holds since the chunk's start,
        and a shorter sequence's padding, are rows of the identity: known corrections, zeros), then every output
        o_t = exp(G_t) S^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) u_j, and each sequence's whole chunks
        folded into its S, G counted from the block's start. U is linear in the block's starting S, so every
        block's system is solved at once for its two parts (the WY form of the chunked delta rule); only S goes
        from block to block, a few small products a block, and the outputs are again one batch. The
        recurrence's arithmetic in other orders (the loop's to float32's rounding), in ~100 kernels and ~8 a
        block however many prompts the step holds: 388 for a 2,000-token prompt, where solving each block in turn
        took 2,572 (~46,000 launches in a 1.5B Qwen3.5's 18 such layers: its 2,000-token prompt took 0.49 s on an
        H200, 65x its compute floor); the state is left as the loop leaves it (S0 at the last chunk's end, the rows since).
        -> [Tp, value_dim], in the layout's token order."""
        spec, device = self.spec, proj.device
        dk, dv, Hv, kernel = spec.key_head_dim, spec.value_head_dim, spec.num_value_heads, spec.conv_kernel
        B, Tp = len(layout.slots), len(layout.rows)
        qkv, z, b, a = proj[layout.rows].split(self.sizes, dim=-1)
        # the convolution, tap by tap: each token's inputs from its sequence's tokens or the inputs it kept
        # ([B, kernel - 1, conv_dim], zeros where fresh)
        kept = torch.where(layout.fresh[:, None, None], 0.0, conv_state[layout.slots])
        inputs = torch.cat((qkv.float(), kept.flatten(0, 1)))
        taps = self.conv[:, 0].T  # [kernel, conv_dim]
        convolved = inputs[layout.taps[0]] * taps[0]
        for j in range(1, kernel):
            convolved = convolved + inputs[layout.taps[j]] * taps[j]
        conv_state[layout.slots] = inputs[layout.kept]

        def padded(x: torch.Tensor) -> torch.Tensor:  # a zero token at Tp, which padding rows read
            return torch.cat((x, x.new_zeros(1, *x.shape[1:])))

        q, k, v = (padded(h) for h in self._heads(convolved))  # [Tp + 1, Hv, dk | dv]
        beta, log_decay = (padded(g) for g in self._gates(b, a))  # [Tp + 1, Hv]
        state = recurrent_state[layout.slots]  # [B, Hv, state_width], a copy written back below
        S0, keys, corrections, log_decays = (
            t.view(B, Hv, *t.shape[1:]) for t in split_state(state.view(B * Hv, -1), dk, dv)
        )
        L, nb, each = BLOCK, len(layout.blocks), torch.arange(B, device=device)
        rows = torch.arange(L, device=device)
        causal = rows[:, None] >= rows  # [L, L]: j <= t
        held = (rows[:CHUNK] < layout.held[:, None])[:, None, :]  # [B, 1, CHUNK]: rows the state holds
        # every block of every sequence: [B, Hv, nb, L, ...]; rows past a sequence's end are padding
        token = layout.tokens.view(B, nb, L)
        Q, K, V = (h[token].permute(0, 3, 1, 2, 4) for h in (q, k, v))
        beta_b, steps = (g[token].permute(0, 3, 1, 2) for g in (beta, log_decay))
        G = steps.cumsum(-1)  # log decay since each block's start
        # block 0: the rows the state holds, their keys, corrections and log decays since the chunk's start
        K[:, :, 0, :CHUNK] = torch.where(held[..., None], keys.transpose(2, 3), K[:, :, 0, :CHUNK])
        known = torch.where(held[..., None], corrections, 0.0)  # [B, Hv, CHUNK, dv]
        at = (layout.held[:, None, None] - 1).clamp(min=0).expand(B, Hv, 1)
        G[:, :, 0] += torch.where(layout.held[:, None, None] > 0, log_decays.gather(-1, at), 0.0)
        G[:, :, 0, :CHUNK] = torch.where(held, log_decays, G[:, :, 0, :CHUNK])
        # what each block folds into S: its sequence's whole chunks (none past its end), and the rows' decay
        firsts = torch.arange(0, nb * L, L, device=device)  # each block's first row
        whole = (layout.ends[:, None] - firsts).clamp(max=L) // CHUNK * CHUNK  # [B, nb]
        at = (whole - 1).clamp(min=0)[:, None, :, None].expand(B, Hv, nb, 1)
        G_end = torch.where(whole[:, None, :, None] > 0, G.gather(-1, at), 0.0)  # [B, Hv, nb, 1]
        w = torch.where(rows < whole[:, None, :, None], (G_end - G).exp(), 0.0)  # [B, Hv, nb, L]
        folds = (K * w[..., None]).transpose(-1, -2)  # [B, Hv, nb, dk, L]
        carried = G_end.exp()[..., None]  # [B, Hv, nb, 1, 1]: what of S a block passes on
        gained = G.exp()[..., None]  # [B, Hv, nb, L, 1]
        S = torch.where(layout.fresh[:, None, None, None], 0.0, S0)  # [B, Hv, dk, dv]
        U = torch.empty_like(V)
        out = torch.empty(Tp + 1, Hv, dv, device=device)  # row Tp: where padding rows' outputs go
        # A block's corrections solve (1 + beta strict) U = beta (V - exp(G) K S) + known, S its state at its
        # start: U = Wv - Wk S, neither part reading S, so a span of blocks is solved at once, then S goes from
        # block to block (three small products each), then the span's outputs at once; spans of at most
        # SEQUENCE_BLOCKS sequence-blocks, which bounds the [.., L, L] and per-block states a step holds
        span = max(1, SEQUENCE_BLOCKS // B)
        for first in range(0, nb, span):
            part = slice(first, min(first + span, nb))
            Qp, Kp, G_p = Q[:, :, part], K[:, :, part], G[:, :, part]
            beta_p, gained_p = beta_b[:, :, part, :, None], gained[:, :, part]
            decay = torch.where(causal, (G_p[..., :, None] - G_p[..., None, :]).exp(), 0.0)  # [.., L, L]
            strict = ((Kp @ Kp.transpose(-1, -2)) * decay).tril(-1)  # j < t
            rhs_v = beta_p * V[:, :, part]
            if first == 0:
                rhs_v[:, :, 0, :CHUNK] += known
            # the diagonal is taken as ones; a held or padding row (beta 0) is a row of the identity
            rhs = torch.cat((rhs_v, beta_p * gained_p * Kp), -1)
            Wv, Wk = torch.linalg.solve_triangular(
                beta_p * strict, rhs, upper=False, unitriangular=True
            ).split((dv, dk), -1)
            starts = []
            for i, block in enumerate(range(part.start, part.stop)):
                starts.append(S)
                U[:, :, block] = Wv[:, :, i] - Wk[:, :, i] @ S
                S = carried[:, :, block] * S + folds[:, :, block] @ U[:, :, block]
            U_p = U[:, :, part]
            outputs = gained_p * (Qp @ torch.stack(starts, 2)) + ((Qp @ Kp.transpose(-1, -2)) * decay) @ U_p
            out[token[:, part].flatten()] = outputs.permute(0, 2, 3, 1, 4).flatten(0, 2)
        # each sequence's rows since its last whole chunk, from its last block
        last = (layout.ends - 1) // L
        since = (whole[each, last][:, None] + rows[:CHUNK]).clamp(max=L - 1)[:, None, :].expand(B, Hv, CHUNK)
        K_since, U_since = (X[each, :, last].gather(2, since[..., None].expand(*since.shape, X.shape[-1]))
                            for X in (K, U))  # fmt: skip
        G_since = G[each, :, last].gather(2, since) - G_end[each, :, last]
        S0.copy_(S)
        keys.copy_(K_since.transpose(2, 3))
        corrections.copy_(U_since)
        log_decays.copy_(G_since)
        recurrent_state[layout.slots] = state
        return self._gated_norm(out[:Tp].to(proj.dtype), z).reshape(Tp, spec.value_dim)

    def _heads(self, convolved: torch.Tensor):
        """[N, conv_dim] convolved inputs -> q, k [N, Hv, dk] (L2-normed per key head, repeated for their value
        heads, q scaled) and v [N, Hv, dv], as _delta_rule makes them of one token."""
        spec, N = self.spec, convolved.shape[0]
        q, k, v = F.silu(convolved).split((spec.key_dim, spec.key_dim, spec.value_dim), dim=-1)
        q, k = (l2_normalize(h.view(N, spec.num_key_heads, spec.key_head_dim)) for h in (q, k))
        group = spec.num_value_heads // spec.num_key_heads
        q, k = (
            h.repeat(1, group, 1) if spec.tiled_value_heads else h.repeat_interleave(group, 1) for h in (q, k)
        )
        return q * spec.key_head_dim**-0.5, k, v.view(N, spec.num_value_heads, spec.value_head_dim)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, Hv] beta = sigmoid(b) and log decay g = -exp(A_log) softplus(a + dt_bias), float32."""
        return b.sigmoid().float(), -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)

    def _convolve(
        self, qkv: torch.Tensor, conv_state: torch.Tensor, slot: int, fresh: bool, keep_each: int = -1
    ) -> torch.Tensor:
        """One sequence's [n, conv_dim] inputs through the causal convolution (before its SiLU) after its kept
        inputs (zeros when fresh), which then become its last conv_kernel - 1 inputs (and, from slot keep_each
        on, those after each token but the last). Tap by tap in a fixed order: products and sums only, each
        element's the same bits in any shape."""
        spec, n = self.spec, qkv.shape[0]
        past = torch.zeros_like(conv_state[slot]) if fresh else conv_state[slot]
        window = torch.cat((past, qkv))  # [kernel - 1 + n, conv_dim]
        conv_state[slot] = window[-(spec.conv_kernel - 1) :]
        if keep_each >= 0:
            for t in range(n - 1):
                conv_state[keep_each + t] = window[t + 1 : t + spec.conv_kernel]
        taps = self.conv[:, 0].T  # [kernel, conv_dim]
        convolved = window[:n] * taps[0]
        for j in range(1, spec.conv_kernel):
            convolved = convolved + window[j : j + n] * taps[j]
        return convolved

    def _delta_rule(
        self, convolved: torch.Tensor, beta, log_decay, state: torch.Tensor, m: int
    ) -> torch.Tensor:
        """One token, the m-th of its chunk: its convolved [conv_dim] inputs as q, k, v (q and k L2-normed per key
        head and repeated for their value heads, q scaled), its row of the state [Hv, state_width] written (and
        the chunk's rows folded into S0 at its last token); S^T q."""
        spec, dk, dv = self.spec, self.spec.key_head_dim, self.spec.value_head_dim
        q, k, v = F.silu(convolved).split((spec.key_dim, spec.key_dim, spec.value_dim))
        group = spec.num_value_heads // spec.num_key_heads
        q, k = (l2_normalize(h.view(spec.num_key_heads, dk)) for h in (q, k))
        # value head h reads key head h // group (Hugging Face's order) or, tiled, h % num_key_heads
        q, k = (
            h.repeat(group, 1) if spec.tiled_value_heads else h.repeat_interleave(group, 0) for h in (q, k)
        )
        q = q * dk**-0.5
        S0, keys, corrections, log_decays = split_state(state, dk, dv)
        G = log_decay + (log_decays[:, m - 1] if m > 0 else 0)  # [Hv]: log decay since the chunk began
        decay = G.exp()
        keys[:, :, m] = k
        log_decays[:, m] = G
        weights = (G[:, None] - log_decays[:, : m + 1]).exp()  # [Hv, m + 1]: exp(G_p - G_j)

        def read(x, rows: int) -> torch.Tensor:  # S^T x: S0's part, then the chunk's rows j < rows
            dots = (keys[:, :, :rows] * x[:, :, None]).sum(1) * weights[:, :rows]  # [Hv, rows]
            from_S0 = decay[:, None] * (S0 * x[:, :, None]).sum(1)
            return from_S0 + (dots[..., None] * corrections[:, :rows]).sum(1)

        recall = read(k, m)  # [Hv, dv]: what S recalls for this key
        corrections[:, m] = (v.view(spec.num_value_heads, dv) - recall) * beta[:, None]
        out = read(q, m + 1)
        if m == CHUNK - 1:  # S0 <- exp(G) S0 + sum_j exp(G - G_j) k_j u_j^T
            scaled = keys * weights[:, None, :]  # [Hv, dk, CHUNK]
            S0.mul_(decay[:, None, None]).add_((scaled[..., None] * corrections[:, None]).sum(2))
        return out

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm of each head's output [Hv, dv] in float32, its weight applied in the model's dtype, times
        silu(z), as the reference rounds them."""
        h = o.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        h = self.gated_norm.to(o.dtype) * h
        return (h * F.silu(z.float().view_as(h))).to(o.dtype)
