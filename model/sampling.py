"""Batched sampling: penalties -> logit bias -> grammar mask -> greedy -> temperature -> top-k -> top-p / min-p ->
seeded draw.

Every stage is a pure tensor function over the whole batch with per-row parameter tensors: no loop over rows, no
host read, so the runner reads the sampled ids back once per step. The draw is Gumbel-max with noise hashed from
(seed, position, token id), so a row's token depends neither on its batch nor on its row index.
"""

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F
from torch import Tensor

from model.device import to_device

# Below this a temperature counts as 0 (greedy): dividing by it could overflow the float32 logits.
MIN_TEMPERATURE = 1e-5

# splitmix64 constants written as signed int64 (torch has no uint64 arithmetic; the bits are the same)
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64
_BELOW_ONE = 1 - 2**-24  # the largest float32 under 1


@dataclass
class SamplingTensors:
    """One step's per-row sampling parameters, on the logits' device. Build it with from_lists()."""

    vocab_size: int  # V, the logits' width; also the padding sentinel of the id tensors
    temperature: Tensor  # [B] f32, 0 = greedy
    top_k: Tensor  # [B] int64, 0 = off
    top_p: Tensor  # [B] f32, 1 = off
    min_p: Tensor  # [B] f32, 0 = off
    repetition_penalty: Tensor  # [B] f32, 1 = off; HF semantics, over prompt + output tokens
    presence_penalty: Tensor  # [B] f32, 0 = off; OpenAI semantics, over output tokens
    frequency_penalty: Tensor  # [B] f32, 0 = off; OpenAI semantics, over output tokens
    seeds: Tensor  # [B] int64, one per row, never absent
    positions: Tensor  # [B] int64, output index of the token being drawn
    prompt_token_ids: Tensor | None  # [B, P] int64 padded with vocab_size; None unless any_penalties
    output_token_ids: Tensor | None  # [B, O] int64 padded with vocab_size; None unless any_penalties
    suppress_ids: Tensor | None  # [B, S] int64 padded with vocab_size, banned this step; None = none
    bias_ids: Tensor | None  # [B, K] int64 padded with vocab_size: OpenAI's logit_bias; None = no row has one
    bias_values: Tensor | None  # [B, K] f32, added to the logits of bias_ids
    # Rows whose output follows a grammar, and their allowed tokens: bit j % 32 of word j // 32 set = token j
    # allowed. None = no row has a grammar (the other rows are never touched).
    grammar_rows: Tensor | None  # [G] int64 row indices
    grammar_bitmask: Tensor | None  # [G, ceil(V / 32)] int32
    # Host-side flags taken from the request params, so stages no row needs are skipped without reading tensors.
    all_greedy: bool
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    # How many of each row's largest logits top-k / top-p look at: the largest top_k, or V (a full sort) when
    # a top-p row has no top-k. A top-k row's nucleus lies inside its top k, so a topk of that width suffices.
    filter_width: int
    any_min_p: bool
    max_num_logprobs: int | None  # K of SampleOutput.top_ids / top_logprobs; None = not wanted

    @classmethod
    def from_lists(
        cls,
        *,
        vocab_size: int,
        device: torch.device | str,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        repetition_penalty: list[float],
        presence_penalty: list[float],
        frequency_penalty: list[float],
        seeds: list[int],
        positions: list[int],
        prompt_token_ids: list[list[int]] | None = None,
        output_token_ids: list[list[int]] | None = None,
        suppress_ids: list[list[int]] | None = None,
        logit_bias: list[dict[int, float]] | None = None,
        grammar_rows: list[int] | None = None,
        grammar_bitmask: Tensor | None = None,
        max_num_logprobs: int | None = None,
    ) -> "SamplingTensors":
        """Per-row python values -> tensors on `device`: two packed host->device copies plus one per id list.

        Token-id lists are read only when needed: prompt/output ids when a row has a penalty, suppress_ids
        (per row, e.g. its stop ids while it has fewer than min_tokens outputs) when a row bans something.
        """
        device = torch.device(device)
        temperature = [0.0 if temp < MIN_TEMPERATURE else float(temp) for temp in temperature]
        # Greedy rows ignore the filters; turning them off there keeps the flags honest.
        top_k = [
            k if temp > 0 and 0 < k < vocab_size else 0 for k, temp in zip(top_k, temperature, strict=True)
        ]
        top_p = [p if temp > 0 else 1.0 for p, temp in zip(top_p, temperature, strict=True)]
        min_p = [p if temp > 0 else 0.0 for p, temp in zip(min_p, temperature, strict=True)]
        any_penalties = any(
            r != 1 or p != 0 or f != 0
            for r, p, f in zip(repetition_penalty, presence_penalty, frequency_penalty, strict=True)
        )
        floats = torch.tensor(
            [temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty],
            dtype=torch.float32,
        )  # [6, B]
        ints = torch.tensor([top_k, seeds, positions], dtype=torch.int64)  # [3, B]
        floats, ints = to_device(floats, device), to_device(ints, device)
        temperature_t, top_p_t, min_p_t, repetition_t, presence_t, frequency_t = floats.unbind(0)
        top_k_t, seeds_t, positions_t = ints.unbind(0)
        needs_sort = any(p < 1 and k == 0 for p, k in zip(top_p, top_k, strict=True))
        filter_width = vocab_size if needs_sort else max(top_k, default=0)
        prompt_t = output_t = suppress_t = None
        if any_penalties:
            assert prompt_token_ids is not None and output_token_ids is not None
            prompt_t = to_device(_pad(prompt_token_ids, vocab_size), device)
            output_t = to_device(_pad(output_token_ids, vocab_size), device)
        if suppress_ids is not None and any(suppress_ids):
            suppress_t = to_device(_pad(suppress_ids, vocab_size), device)
        bias_ids_t = bias_values_t = None
        if logit_bias is not None and any(logit_bias):
            bias_ids_t = to_device(_pad([list(b) for b in logit_bias], vocab_size), device)
            bias_values_t = to_device(
                _pad([list(b.values()) for b in logit_bias], 0.0, torch.float32), device
            )
        grammar_rows_t = grammar_bitmask_t = None
        if grammar_rows:
            grammar_rows_t = to_device(torch.tensor(grammar_rows, dtype=torch.int64), device)
            grammar_bitmask_t = to_device(grammar_bitmask, device)
        return cls(
            vocab_size=vocab_size,
            temperature=temperature_t,
            top_k=top_k_t,
            top_p=top_p_t,
            min_p=min_p_t,
            repetition_penalty=repetition_t,
            presence_penalty=presence_t,
            frequency_penalty=frequency_t,
            seeds=seeds_t,
            positions=positions_t,
            prompt_token_ids=prompt_t,
            output_token_ids=output_t,
            suppress_ids=suppress_t,
            bias_ids=bias_ids_t,
            bias_values=bias_values_t,
            grammar_rows=grammar_rows_t,
            grammar_bitmask=grammar_bitmask_t,
            all_greedy=all(temp == 0 for temp in temperature),
            any_penalties=any_penalties,
            any_top_k=any(top_k),
            any_top_p=any(p < 1 for p in top_p),
            filter_width=filter_width,
            any_min_p=any(p > 0 for p in min_p),
            max_num_logprobs=max_num_logprobs,
        )


@dataclass
class SampleOutput:
    token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] f32, log_softmax of the raw logits (before penalties, temperature) at
    # token_ids; None unless max_num_logprobs is set (the log-sum-exp over the vocabulary is not free)
    top_ids: Tensor | None  # [B, K] int64, the K largest raw logits, most likely first; None unless asked
    top_logprobs: Tensor | None  # [B, K] f32, their raw logprobs


def _pad(rows: list[list], pad: float, dtype: torch.dtype = torch.int64) -> Tensor:
    """Ragged lists -> [B, max_len] of `dtype`, padded with `pad`, built from one flat host tensor."""
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    out = torch.full((len(rows), max((len(row) for row in rows), default=0)), pad, dtype=dtype)
    out[torch.arange(out.shape[1]) < lengths[:, None]] = torch.tensor(list(chain(*rows)), dtype=dtype)
    return out


# Row sums go through this many partial sums of equal width: torch splits a lone row's sum across threads but
# gives each row of a larger batch one thread, so a plain sum's rounding depends on the batch size (a row's
# logsumexp differed in the last bit from 6 rows up). Many partials of fixed width always split one way.
ROW_SUM_PARTS = 64


def row_sum(x: Tensor) -> Tensor:
    """[B, V] -> [B] sums whose bits do not depend on B."""
    pad = (-x.shape[1]) % ROW_SUM_PARTS
    if pad:
        x = F.pad(x, (0, pad))
    return x.view(x.shape[0], ROW_SUM_PARTS, -1).sum(-1).sum(-1)


def row_logsumexp(x: Tensor) -> Tensor:
    """[B, V] f32 -> [B], batch-invariant (see ROW_SUM_PARTS)."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(m.isfinite(), m, 0.0)  # a row of -inf stays -inf
    return row_sum((x - m).exp()).log() + m.squeeze(-1)


def row_softmax(x: Tensor) -> Tensor:
    """[B, V] f32 -> softmax over each row, batch-invariant (see ROW_SUM_PARTS)."""
    m = x.amax(dim=-1, keepdim=True)
    e = (x - torch.where(m.isfinite(), m, 0.0)).exp()
    return e / row_sum(e)[:, None]


def apply_penalties(
    logits: Tensor,
    prompt_ids: Tensor,
    output_ids: Tensor,
    repetition: Tensor,
    presence: Tensor,
    frequency: Tensor,
) -> Tensor:
    """logits [B, V] f32 -> penalised copy. Ids [B, P] / [B, O] padded with V; penalties [B].

    Repetition (HF): a logit of a token in prompt or output is divided by it when positive, multiplied when not.
    Presence and frequency (OpenAI), over output tokens: logit -= presence * (count > 0) + frequency * count.
    Works on the ids with gather/scatter, so beyond the copy nothing is [B, V]. Where an id repeats, scatter_
    writes the same value from every copy, so the result is deterministic.
    """
    vocab_size = logits.shape[1]
    x = F.pad(logits, (0, 1))  # [B, V + 1]: the padding id V lands in the extra column
    ids = torch.cat([prompt_ids, output_ids], dim=1)  # [B, P + O]
    hit = x.gather(1, ids)
    rep = repetition[:, None]
    x.scatter_(1, ids, torch.where(hit > 0, hit / rep, hit * rep))
    x.scatter_add_(1, output_ids, (-frequency)[:, None].expand(output_ids.shape))  # once per occurrence
    x.scatter_(1, output_ids, x.gather(1, output_ids) - presence[:, None])  # once per distinct id
    return x[:, :vocab_size]


def apply_logit_bias(logits: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    """logits [B, V] -> copy with values [B, K] added at each row's ids [B, K] (distinct, padded with V)."""
    x = F.pad(logits, (0, 1))  # [B, V + 1]: the padding id V lands in the extra column
    return x.scatter_add_(1, ids, values)[:, : logits.shape[1]]


def suppress_tokens(logits: Tensor, ids: Tensor) -> Tensor:
    """logits [B, V] -> copy with each row's ids [B, S] (padded with V) set to -inf."""
    x = F.pad(logits, (0, 1))  # [B, V + 1]: the padding id V lands in the extra column
    return x.scatter_(1, ids, -torch.inf)[:, : logits.shape[1]]


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    """logits [B, V] -> copy where each of `rows` [G] keeps only the tokens its bitmask [G, ceil(V / 32)] int32
    allows (bit j % 32 of word j // 32); the other rows are left as they are."""
    num_rows, vocab_size = rows.shape[0], logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(num_rows, -1)[:, :vocab_size].bool()  # [G, V]
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, -torch.inf))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, width: int) -> Tensor:
    """Set to -inf what lies outside each row's top-k, then outside the top-p nucleus of what is left.

    logits [B, V] f32; top_k [B] (0 = off; None = no row uses it); top_p [B] (1 = off; None = no row uses it);
    width: how many of each row's largest logits they need (SamplingTensors.filter_width). Values tied with the
    last kept one are kept too. Both filters become a per-row floor on the logits.
    """
    vocab_size = logits.shape[1]
    if width < vocab_size:
        desc = logits.topk(width, dim=-1).values  # [B, width], sorted
    else:
        desc = logits.sort(dim=-1, descending=True).values  # [B, V]
    if top_k is not None:
        kth = desc.gather(1, (top_k - 1).clamp(min=0)[:, None])  # [B, 1]
        kth = kth.masked_fill(top_k[:, None] == 0, -torch.inf)
        logits = logits.masked_fill(logits < kth, -torch.inf)
        desc = desc.masked_fill(desc < kth, -torch.inf)
    if top_p is not None:
        # Sorted position i is kept when the mass before it is under top_p: the count of cumsums under top_p
        # is the index of the last kept one. A top-k row's window holds all its mass, so the softmax over the
        # window is its renormalised top-k distribution.
        cumsum = row_softmax(desc).cumsum_(dim=-1)  # [B, width]
        last = (cumsum < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(max=width - 1)  # [B, 1]
        # top_p = 1 keeps everything, even tokens whose mass vanished in float32 rounding.
        floor = desc.gather(1, last).masked_fill(top_p[:, None] >= 1, -torch.inf)
        logits = logits.masked_fill(logits < floor, -torch.inf)
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose prob is under min_p [B] times the row's top prob: in logits, under max + log(min_p)."""
    floor = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # min_p = 0 -> -inf, keeps all
    return logits.masked_fill(logits < floor, -torch.inf)


def _xor_shift_(z: Tensor, shift: int, scratch: Tensor) -> Tensor:
    """z ^= z >>> shift (logical), in place."""
    torch.bitwise_right_shift(z, shift, out=scratch)
    scratch &= (1 << (64 - shift)) - 1  # torch's >> on int64 copies the sign bit: clear those
    return z.bitwise_xor_(scratch)


def _mix_(z: Tensor) -> Tensor:
    """splitmix64's finaliser, in place on int64: a bijection spreading every input bit over the output."""
    scratch = torch.empty_like(z)
    _xor_shift_(z, 30, scratch).mul_(_MUL1)  # int64 products wrap modulo 2**64 on CPU and CUDA
    _xor_shift_(z, 27, scratch).mul_(_MUL2)
    return _xor_shift_(z, 31, scratch)


def uniform_noise(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """seeds [B], positions [B] int64 -> [B, V] f32 uniforms in (0, 1), a pure function of (seed, position, id).

    Counter-based (splitmix64 of a row key plus id * gamma): no generator state, no host read, same bits on
    every device. Peak: two [B, V] int64, 16 bytes per element (512 MiB at B=256, V=128k).
    """
    # The position goes through a mix so the next step is not the same stream shifted by one id.
    key = _mix_(_mix_(seeds + _GAMMA) ^ positions)  # [B]
    z = key[:, None] + torch.arange(vocab_size, device=seeds.device) * _GAMMA  # [B, V], wrapping
    bits = _mix_(z).bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)  # top 53 bits, non-negative
    # (k + 0.5) / 2**53 is never 0; float32 rounding can reach 1, hence the clamp.
    return bits.float().add_(0.5).mul_(2**-53).clamp_(max=_BELOW_ONE)


def row_argmax(x: Tensor) -> Tensor:
    """[B, V] -> [B] int64: the first index of each row's largest value (a NaN counts as the largest)."""
    return x.argmax(dim=-1)


@dataclass(frozen=True)
class SamplerKernels:
    """The sampler's passes over the whole [B, V] that PyTorch's ops run slowly on a CPU: the draw's noise (~0.26
    ms a row of a 49k vocabulary) and the argmax (1.3 ms for 32 such rows, ~3% of a 32-sequence decode step of
    the default model). PyTorch's ops by default; kvserve's CPU kernels (model/csrc/noise.cpp, argmax.cpp)
    compute their very bits."""

    noise: Callable = uniform_noise
    argmax: Callable = row_argmax


TORCH_SAMPLER = SamplerKernels()


def draw(logits: Tensor, seeds: Tensor, positions: Tensor, kernels: SamplerKernels = TORCH_SAMPLER) -> Tensor:
    """logits [B, V] f32 (-inf = banned) -> [B] ids, one sample of softmax(logits) per row by Gumbel-max."""
    u = kernels.noise(seeds, positions, logits.shape[1])  # [B, V]
    # G = -log(E) with E = -log(1 - u) ~ Exp(1); log1p keeps float32 precision where E is small and G large,
    # the tail that lets unlikely tokens win.
    gumbel = u.neg_().log1p_().neg_().log_().neg_()
    return kernels.argmax(gumbel.add_(logits))


def sample(logits: Tensor, t: SamplingTensors, kernels: SamplerKernels = TORCH_SAMPLER) -> SampleOutput:
    """logits [B, V] of any float dtype (left untouched) -> one token per row plus raw logprobs. kernels: what
    computes the draw's noise and the argmax (SamplerKernels).

    Peak memory beyond the input is the draw's: the working f32 logits plus the noise's two int64, about
    20 bytes per element (640 MiB at B=256, V=128k); the top-p sort needs a little less.
    """
    assert logits.shape[1] == t.vocab_size, (tuple(logits.shape), t.vocab_size)
    # Upcast once. Every stage below returns a new tensor, so `x` may alias the caller's float32 logits.
    x = logits.float()  # [B, V]
    top_ids = top_logprobs = lse = None
    if t.max_num_logprobs is not None:
        lse = row_logsumexp(x)  # [B]
        top_values, top_ids = x.topk(t.max_num_logprobs, dim=-1)  # [B, K]
        top_logprobs = top_values - lse[:, None]

    if t.any_penalties:
        x = apply_penalties(
            x,
            t.prompt_token_ids,
            t.output_token_ids,
            t.repetition_penalty,
            t.presence_penalty,
            t.frequency_penalty,
        )
    if t.bias_ids is not None:
        x = apply_logit_bias(x, t.bias_ids, t.bias_values)
    if t.suppress_ids is not None:
        x = suppress_tokens(x, t.suppress_ids)
    if t.grammar_rows is not None:
        x = apply_token_bitmask(x, t.grammar_rows, t.grammar_bitmask)
    token_ids = kernels.argmax(x)  # [B], the greedy answer
    if not t.all_greedy:
        x = x / torch.where(t.temperature > 0, t.temperature, 1.0)[:, None]
        if t.any_top_k or t.any_top_p:
            top_k = t.top_k if t.any_top_k else None
            x = apply_top_k_top_p(x, top_k, t.top_p if t.any_top_p else None, t.filter_width)
        if t.any_min_p:
            x = apply_min_p(x, t.min_p)
        token_ids = torch.where(t.temperature > 0, draw(x, t.seeds, t.positions, kernels), token_ids)

    logprobs = None if lse is None else logits.gather(1, token_ids[:, None]).squeeze(1).float() - lse
    return SampleOutput(token_ids, logprobs, top_ids, top_logprobs)
