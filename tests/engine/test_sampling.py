import math

import pytest
import torch

from model.sampling import (
    SamplerKernels,
    SamplingTensors,
    apply_penalties,
    apply_top_k_top_p,
    row_softmax,
    sample,
    uniform_noise,
)

MASK64 = (1 << 64) - 1


def make(vocab_size: int, num_rows: int, **rows) -> SamplingTensors:
    """SamplingTensors with neutral per-row values (temperature 1, no filters, seed 0, positions 0..B-1)."""
    lists = dict(
        temperature=[1.0] * num_rows,
        top_k=[0] * num_rows,
        top_p=[1.0] * num_rows,
        min_p=[0.0] * num_rows,
        repetition_penalty=[1.0] * num_rows,
        presence_penalty=[0.0] * num_rows,
        frequency_penalty=[0.0] * num_rows,
        seeds=[0] * num_rows,
        positions=list(range(num_rows)),
        prompt_token_ids=[[] for _ in range(num_rows)],
        output_token_ids=[[] for _ in range(num_rows)],
    )
    max_num_logprobs = rows.pop("max_num_logprobs", None)
    suppress_ids = rows.pop("suppress_ids", None)
    lists.update(rows)
    return SamplingTensors.from_lists(
        vocab_size=vocab_size,
        device="cpu",
        suppress_ids=suppress_ids,
        max_num_logprobs=max_num_logprobs,
        **lists,
    )


def frequencies(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab_size).double() / ids.numel()


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


def penalise(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    return apply_penalties(
        logits,
        t.prompt_token_ids,
        t.output_token_ids,
        t.repetition_penalty,
        t.presence_penalty,
        t.frequency_penalty,
    )


def repeat_row(logits: torch.Tensor, n: int) -> torch.Tensor:
    return logits[None].expand(n, -1).contiguous()


@pytest.mark.timeout(60)
def test_temperature_zero_is_argmax_of_penalised_logits():
    torch.manual_seed(0)
    vocab_size, n = 500, 8
    logits = torch.randn(n, vocab_size)
    out = sample(logits, make(vocab_size, n, temperature=[0.0] * n))
    assert torch.equal(out.token_ids, logits.argmax(-1))

    # A tiny temperature counts as greedy; penalties apply before the argmax.
    prompts = [logits[i].topk(3).indices.tolist() for i in range(n)]
    outputs = [[int(logits[i].argmax())] * 2 for i in range(n)]
    params = dict(repetition_penalty=[1.5] * n, presence_penalty=[0.5] * n, frequency_penalty=[0.3] * n)
    t = make(
        vocab_size, n, temperature=[1e-7] * n, prompt_token_ids=prompts, output_token_ids=outputs, **params
    )
    assert t.all_greedy and t.any_penalties
    expected = penalise(logits, t).argmax(-1)
    assert not torch.equal(expected, logits.argmax(-1))  # the penalties did move something
    assert torch.equal(sample(logits, t).token_ids, expected)

    # Greedy rows mixed with sampled rows, filters set on the greedy rows too, bf16 input.
    temps = [0.0, 1.0] * (n // 2)
    t = make(
        vocab_size,
        n,
        temperature=temps,
        top_k=[5] * n,
        top_p=[0.5] * n,
        min_p=[0.1] * n,
        **params,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
    )
    assert not t.all_greedy
    got = sample(logits.bfloat16(), t).token_ids
    greedy = penalise(logits.bfloat16().float(), t).argmax(-1)
    assert torch.equal(got[0::2], greedy[0::2])


@pytest.mark.timeout(60)
def test_top_k_stays_in_the_k_most_likely():
    torch.manual_seed(1)
    vocab_size, n, k = 64, 4000, 5
    logits = torch.randn(vocab_size) * 2
    allowed = set(logits.topk(k).indices.tolist())
    t = make(vocab_size, n, top_k=[k] * n, seeds=list(range(n)))
    drawn = set(sample(repeat_row(logits, n), t).token_ids.tolist())
    assert drawn == allowed


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i].item()
        if mass >= top_p:
            return kept
    return kept


@pytest.mark.timeout(60)
def test_top_p_stays_in_the_smallest_nucleus():
    torch.manual_seed(2)
    vocab_size, n = 40, 4000
    logits = torch.randn(vocab_size) * 1.5
    for top_p in (0.3, 0.75, 0.95):
        allowed = nucleus(logits, top_p)
        t = make(vocab_size, n, top_p=[top_p] * n, seeds=[7] * n)
        drawn = set(sample(repeat_row(logits, n), t).token_ids.tolist())
        assert drawn <= allowed
        assert len(drawn) >= len(allowed) - 1  # the tail member may be rare, but the rest all show up

    # top-k first, then the nucleus of the renormalised top-k.
    k, top_p = 8, 0.6
    restricted = torch.full_like(logits, -math.inf)
    top = logits.topk(k).indices
    restricted[top] = logits[top]
    allowed = nucleus(restricted, top_p)
    t = make(vocab_size, n, top_k=[k] * n, top_p=[top_p] * n)
    drawn = set(sample(repeat_row(logits, n), t).token_ids.tolist())
    assert drawn <= allowed and len(drawn) >= len(allowed) - 1

    # top_p = 1 keeps even the tokens whose mass float32 rounds away (the cumsum reaches 1 after the first).
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0
    kept = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]), width=1000)
    assert kept[0].isfinite().all() and kept[1].isfinite().sum() == 1

    # top_p = 0 (which OpenAI's API takes) keeps the most likely token alone
    row = torch.randn(vocab_size) * 1.5
    t = make(vocab_size, n, top_p=[0.0] * n, seeds=[7] * n)
    assert set(sample(repeat_row(row, n), t).token_ids.tolist()) == {int(row.argmax())}


@pytest.mark.timeout(60)
def test_min_p_drops_tokens_under_the_fraction_of_the_top_prob():
    torch.manual_seed(3)
    vocab_size, n, min_p = 40, 4000, 0.1
    logits = torch.randn(vocab_size) * 1.5
    temperature = 0.7
    probs = (logits / temperature).softmax(-1)
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    t = make(vocab_size, n, min_p=[min_p] * n, temperature=[temperature] * n)
    drawn = set(sample(repeat_row(logits, n), t).token_ids.tolist())
    assert drawn <= allowed and len(drawn) >= len(allowed) - 1


@pytest.mark.timeout(60)
def test_seeded_row_is_the_same_alone_and_in_any_batch():
    torch.manual_seed(4)
    vocab_size = 300
    prompt, output = [3, 4, 5, 9], [7, 7, 11]
    row = dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        prompt_token_ids=prompt,
        output_token_ids=output,
    )
    others = [  # different params, widths and lengths, so the padding and the stages differ
        dict(
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            prompt_token_ids=list(range(40)),
            output_token_ids=[],
        ),
        dict(
            temperature=1.3,
            top_k=3,
            top_p=1.0,
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=-1.0,
            frequency_penalty=0.0,
            prompt_token_ids=[1],
            output_token_ids=list(range(20)),
        ),
        dict(
            temperature=1.0,
            top_k=0,
            top_p=0.5,
            min_p=0.3,
            repetition_penalty=0.9,
            presence_penalty=0.0,
            frequency_penalty=1.0,
            prompt_token_ids=[],
            output_token_ids=[2],
        ),
    ]
    mismatches = 0
    for seed in range(40):
        logits = torch.randn(5, vocab_size)
        alone = {key: [value] for key, value in row.items()}
        alone_ids = sample(logits[2:3], make(vocab_size, 1, seeds=[seed], positions=[9], **alone)).token_ids
        batch_rows = others[:2] + [row] + others[2:] + [others[0]]
        batch = {key: [r[key] for r in batch_rows] for key in row}
        t = make(vocab_size, 5, seeds=[seed + 1000, 5, seed, 6, 8], positions=[0, 9, 9, 3, 9], **batch)
        mismatches += int(sample(logits, t).token_ids[2] != alone_ids[0])
    assert mismatches == 0


@pytest.mark.timeout(60)
def test_different_seeds_and_positions_give_different_draws():
    vocab_size, n = 1000, 200
    logits = torch.zeros(n, vocab_size)
    by_seed = sample(logits, make(vocab_size, n, seeds=list(range(n)), positions=[5] * n)).token_ids
    by_position = sample(logits, make(vocab_size, n, seeds=[5] * n, positions=list(range(n)))).token_ids
    # 200 uniform draws over 1000 ids: about 181 distinct expected
    assert len(set(by_seed.tolist())) > 160
    assert len(set(by_position.tolist())) > 160
    assert (by_seed != by_position).sum() > 180


@pytest.mark.timeout(60)
def test_frequencies_match_the_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    n = 20000
    expected = logits.double().softmax(-1)
    over_positions = sample(repeat_row(logits, n), make(5, n, seeds=[123] * n)).token_ids
    assert total_variation(frequencies(over_positions, 5), expected) < 0.02
    over_seeds = sample(repeat_row(logits, n), make(5, n, seeds=list(range(n)), positions=[0] * n)).token_ids
    assert total_variation(frequencies(over_seeds, 5), expected) < 0.02

    # Unfiltered rows keep the full distribution next to rows using every filter.
    for filters, allowed in [
        (dict(top_k=[2, 0]), {0, 1}),
        (dict(top_p=[0.5, 1.0]), {0, 1}),  # probs 0.445, 0.270, 0.164, ...
        (dict(min_p=[0.5, 0.0]), {0, 1}),
        (dict(top_k=[3, 0], top_p=[0.5, 1.0]), {0}),  # top-3 renormalised: 0.506, 0.307, 0.186
    ]:
        t = make(5, 2 * n, seeds=[7] * (2 * n), **{name: values * n for name, values in filters.items()})
        ids = sample(repeat_row(logits, 2 * n), t).token_ids
        assert set(ids[0::2].tolist()) == allowed
        assert total_variation(frequencies(ids[1::2], 5), expected) < 0.02


@pytest.mark.timeout(60)
def test_temperature_scales_the_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    n = 20000
    top_share = {}
    for temperature in (0.5, 1.0, 2.0):
        t = make(5, n, temperature=[temperature] * n, seeds=[99] * n)
        freq = frequencies(sample(repeat_row(logits, n), t).token_ids, 5)
        assert total_variation(freq, (logits.double() / temperature).softmax(-1)) < 0.02
        top_share[temperature] = freq[0].item()
    assert top_share[0.5] > top_share[1.0] + 0.1 > top_share[2.0] + 0.2


@pytest.mark.timeout(60)
def test_penalties_change_exactly_the_right_logits():
    vocab_size = 8
    logits = torch.tensor(
        [[1.0, 2.0, -1.0, 0.5, -3.0, 4.0, 0.0, -0.5], [1.0, 2.0, -1.0, 0.5, -3.0, 4.0, 0.0, -0.5]]
    )
    t = make(
        vocab_size,
        2,
        repetition_penalty=[2.0, 1.0],
        presence_penalty=[0.5, 0.0],
        frequency_penalty=[0.25, 0.0],
        prompt_token_ids=[[1, 2, 4, 1], [0, 1, 2, 3]],
        output_token_ids=[[2, 3, 3, 6], []],
    )
    got = penalise(logits, t)
    expected = logits[0].clone()
    expected[1] = 2.0 / 2  # prompt only (twice): repetition once, positive -> divided
    expected[4] = -3.0 * 2  # prompt only, negative -> multiplied
    expected[2] = -1.0 * 2 - 0.5 - 0.25  # prompt and output once: multiplied, then presence + 1 x frequency
    expected[3] = 0.5 / 2 - 0.5 - 2 * 0.25  # output twice
    expected[6] = 0.0 * 2 - 0.5 - 0.25  # zero logit: multiplied (stays 0), then presence + frequency
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], logits[1], rtol=0, atol=0)  # neutral values change nothing
    assert got.data_ptr() != logits.data_ptr() and logits[0, 1] == 2.0  # input left alone


@pytest.mark.timeout(60)
def test_logprobs_are_raw_and_top_ids_are_the_raw_top_k():
    torch.manual_seed(5)
    vocab_size, n = 100, 6
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(n, vocab_size) * 3).to(dtype)
        t = make(
            vocab_size,
            n,
            temperature=[0.0, 0.5, 1.0, 2.0, 1.0, 0.7],
            top_k=[0, 10, 0, 0, 3, 0],
            repetition_penalty=[1.3] * n,
            output_token_ids=[[0, 1]] * n,
            max_num_logprobs=4,
        )
        out = sample(logits, t)
        raw = logits.float().log_softmax(-1)
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
        assert torch.equal(out.top_ids, logits.float().topk(4).indices)
        torch.testing.assert_close(out.top_logprobs, raw.topk(4).values)
        assert out.logprobs.dtype == torch.float32 and out.token_ids.dtype == torch.int64
    assert sample(logits, make(vocab_size, n)).top_ids is None


def everything_on(vocab_size: int, n: int) -> SamplingTensors:
    return make(
        vocab_size,
        n,
        temperature=[0.0] + [0.9] * (n - 1),
        top_k=[20] * n,
        top_p=[0.9] * n,
        min_p=[0.05] * n,
        repetition_penalty=[1.1] * n,
        presence_penalty=[0.2] * n,
        frequency_penalty=[0.1] * n,
        prompt_token_ids=[[1, 2, 3]] * n,
        output_token_ids=[[4, 4]] * n,
        suppress_ids=[[0]] * n,
        max_num_logprobs=5,
        seeds=list(range(n)),
    )


@pytest.mark.timeout(60)
def test_sample_never_reads_tensors_on_the_host(monkeypatch):
    vocab_size, n = 200, 4
    logits = torch.randn(n, vocab_size)
    t = everything_on(vocab_size, n)

    def refuse(*args, **kwargs):
        raise AssertionError("host read inside the sampler")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = sample(logits, t)
    monkeypatch.undo()
    assert out.token_ids.shape == (n,)


@pytest.mark.cuda
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_does_not_sync_and_matches_cpu():
    vocab_size, n = 4096, 16
    logits = torch.randn(n, vocab_size)
    cpu = everything_on(vocab_size, n)
    cuda = SamplingTensors(
        **{
            name: value.cuda() if isinstance(value, torch.Tensor) else value
            for name, value in vars(cpu).items()
        }
    )
    logits_cuda = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits_cuda, cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.token_ids.cpu(), sample(logits, cpu).token_ids)
    assert torch.equal(
        uniform_noise(cuda.seeds, cuda.positions, vocab_size).cpu(),
        uniform_noise(cpu.seeds, cpu.positions, vocab_size),
    )


def reference_uniform(seed: int, position: int, token: int) -> float:
    """The hash in plain Python integers: splitmix64 with explicit 64-bit wrapping."""
    gamma = 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    key = mix(mix((seed + gamma) & MASK64) ^ (position & MASK64))
    return ((mix((key + token * gamma) & MASK64) >> 11) + 0.5) / 2**53


@pytest.mark.timeout(60)
def test_uniform_noise_is_a_pure_roughly_uniform_hash():
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789])
    positions = torch.tensor([0, 0, 5, 7, 1_000_000, -3])
    vocab_size = 4099  # odd width, so rows do not line up with vector lanes
    u = uniform_noise(seeds, positions, vocab_size)
    assert u.shape == (6, vocab_size) and u.dtype == torch.float32
    assert torch.equal(u, uniform_noise(seeds, positions, vocab_size))
    assert u.min() > 0 and u.max() < 1
    for b, v in [(0, 0), (1, 5), (2, 4098), (3, 17), (4, 1000), (5, 2)]:
        expected = reference_uniform(int(seeds[b]), int(positions[b]), v)
        assert abs(u[b, v].item() - expected) < 1e-6, (b, v)
    # A row's noise depends only on its own (seed, position), bit for bit.
    assert torch.equal(uniform_noise(seeds[3:4], positions[3:4], vocab_size)[0], u[3])

    # Roughly uniform, and neighbouring tokens / positions uncorrelated.
    u = uniform_noise(torch.arange(64), torch.full((64,), 3), 4096).double()
    assert abs(u.mean().item() - 0.5) < 0.005
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts / u.numel() - 0.1).abs().max() < 0.005
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()) < 0.01
    next_step = uniform_noise(torch.arange(64), torch.full((64,), 4), 4096).double()
    assert abs(torch.corrcoef(torch.stack([u.flatten(), next_step.flatten()]))[0, 1].item()) < 0.01


@pytest.mark.timeout(60)
def test_the_cpu_kernels_noise_has_the_same_bits(tier_kernels):
    """model/csrc/noise.cpp against uniform_noise: every bit, at extreme seeds and positions, over rows that
    straddle the kernel's parallel chunks (16,384 elements), and a row alone as in a batch."""
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789, 42])
    positions = torch.tensor([0, 0, 5, 7, 1_000_000, -3, 2**40])
    for vocab_size in (1, 31, 4099, 49152):
        ours = tier_kernels.uniform_noise(seeds, positions, vocab_size)
        assert torch.equal(ours, uniform_noise(seeds, positions, vocab_size)), vocab_size
        assert torch.equal(tier_kernels.uniform_noise(seeds[2:3], positions[2:3], vocab_size)[0], ours[2])
    empty = torch.zeros(0, dtype=torch.int64)
    assert tier_kernels.uniform_noise(empty, empty, 8).shape == (0, 8)


@pytest.mark.timeout(60)
def test_the_cpu_kernels_argmax_is_torchs(tier_kernels):
    """model/csrc/argmax.cpp against torch.argmax on every row: the first of equal maxima, a NaN over any number
    (the first NaN), infinities, rows of -inf only, maxima in the vector part and in the tail past it, widths
    around the vector's (16 lanes with AVX-512, 8 with AVX2, 4 on the baseline); and a row alone as in a batch."""
    g = torch.Generator().manual_seed(0)
    for width in [*range(1, 40), 4099, 49152]:
        rows = torch.randn(12, width, generator=g)
        rows[1] = rows[1].round()  # many ties
        rows[2] = float("-inf")
        rows[3, width // 3] = rows[3, width - 1] = float("nan")
        rows[4, width - 1] = float("nan")  # in the tail
        rows[5, width // 2] = float("inf")
        rows[6] = 7.0  # all equal
        rows[7, [width // 4, width - 1]] = 1e9  # the same maximum twice, the second in the tail
        rows[8] = float("nan")
        rows[9, torch.randint(width, (3,), generator=g)] = float("nan")
        rows[10, 0] = float("inf")
        rows[10, width - 1] = float("nan")
        ours = tier_kernels.argmax_rows(rows)
        assert torch.equal(ours, rows.argmax(dim=-1)), width
        assert tier_kernels.argmax_rows(rows[5:6]).item() == ours[5].item()
        assert torch.equal(tier_kernels.argmax_rows(rows.t().contiguous().t()), ours)  # strided rows
    with pytest.raises(RuntimeError, match="float32"):
        tier_kernels.argmax_rows(torch.zeros(2, 5, dtype=torch.float64))


@pytest.mark.timeout(60)
def test_the_sampler_picks_the_same_tokens_with_the_cpu_kernels(tier_kernels):
    """sample() with the kernels' noise and argmax: the same tokens as with PyTorch's ops, greedy and drawn."""
    vocab_size, n = 4099, 16
    logits = torch.randn(n, vocab_size, generator=torch.Generator().manual_seed(1)) * 3
    kernels = SamplerKernels(tier_kernels.uniform_noise, tier_kernels.argmax_rows)
    for temperature in (0.0, 0.7, 1.0):
        t = make(vocab_size, n, temperature=[temperature] * n, seeds=list(range(n)))
        assert torch.equal(sample(logits, t, kernels).token_ids, sample(logits, t).token_ids), temperature


@pytest.mark.timeout(60)
def test_stop_ids_are_suppressed_before_min_tokens():
    vocab_size, n = 50, 2000
    logits = torch.zeros(3, vocab_size)
    logits[:, 7] = 10.0  # the "eos": argmax of every row
    t = make(vocab_size, 3, temperature=[0.0, 0.0, 1.0], suppress_ids=[[7, 9], [], [7]])
    assert sample(logits, t).token_ids.tolist()[:2] == [int(logits[0, :7].argmax()), 7]
    t = make(vocab_size, n, suppress_ids=[[7]] * n, seeds=list(range(n)))
    assert 7 not in sample(repeat_row(logits[0], n), t).token_ids.tolist()
    assert make(vocab_size, 2, suppress_ids=[[], []]).suppress_ids is None


@pytest.mark.timeout(60)
def test_from_lists_normalises_params_and_flags():
    vocab_size = 10
    t = make(
        vocab_size,
        4,
        temperature=[0.0, 1.0, 1.0, 1.0],
        top_k=[3, -1, 10, 4],
        top_p=[0.5, 1.0, 1.0, 1.0],
        min_p=[0.5, 0.0, 0.0, 0.0],
    )
    assert t.top_k.tolist() == [0, 0, 0, 4]  # off for greedy rows, -1 and >= V mean off
    assert t.any_top_k and t.filter_width == 4 and not t.any_top_p and not t.any_min_p and not t.all_greedy
    t = make(vocab_size, 3, top_k=[0, 3, 5], top_p=[1.0, 0.5, 1.0])
    assert t.filter_width == 5  # every top-p row has a top-k: a topk of the largest k is enough
    t = make(vocab_size, 3, top_k=[0, 3, 5], top_p=[0.9, 0.5, 1.0])
    assert t.filter_width == vocab_size  # row 0 needs the full sort
    assert not t.any_penalties and t.prompt_token_ids is None and t.output_token_ids is None
    t = make(
        vocab_size,
        2,
        frequency_penalty=[0.0, 0.5],
        prompt_token_ids=[[1, 2, 3], []],
        output_token_ids=[[], [4]],
    )
    assert t.any_penalties
    assert t.prompt_token_ids.tolist() == [[1, 2, 3], [vocab_size] * 3]
    assert t.output_token_ids.tolist() == [[vocab_size], [4]]
    assert t.seeds.dtype == torch.int64 and t.temperature.dtype == torch.float32


@pytest.mark.timeout(60)
def test_logit_bias_is_added_to_its_rows_logits_only():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    top, least = 0, 3
    # greedy: +100 makes the least likely token the answer, -100 removes the argmax, no bias changes nothing
    t = make(5, 3, temperature=[0.0] * 3, logit_bias=[{least: 100.0}, {top: -100.0}, {}])
    assert sample(repeat_row(logits, 3), t).token_ids.tolist() == [least, 1, top]
    # sampled: a bias b multiplies the token's odds by e^b; rows of other biases share the batch
    n = 20000
    biased = logits.clone()
    biased[2] += 1.5
    biased[top] -= 0.5
    t = make(5, 2 * n, seeds=list(range(2 * n)), logit_bias=[{2: 1.5, top: -0.5}, {}] * n)
    ids = sample(repeat_row(logits, 2 * n), t).token_ids
    assert total_variation(frequencies(ids[0::2], 5), biased.double().softmax(-1)) < 0.02
    assert total_variation(frequencies(ids[1::2], 5), logits.double().softmax(-1)) < 0.02
    # a row's draw is the same whatever the other rows' biases
    alone = sample(repeat_row(logits, 1), make(5, 1, seeds=[5], logit_bias=[{2: 1.5}])).token_ids
    mixed = make(5, 3, seeds=[5, 6, 7], positions=[0, 0, 0], logit_bias=[{2: 1.5}, {0: 9.0, 1: 3.0}, {}])
    assert sample(repeat_row(logits, 3), mixed).token_ids[0] == alone[0]
    assert make(5, 2, logit_bias=[{}, {}]).bias_ids is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab_size", [49152, 151936])
def test_logprobs_and_nucleus_of_a_row_are_the_same_bits_in_any_batch(vocab_size):
    """At a real vocabulary's width torch sums a lone row on two threads and a batch's rows on one each: the
    sampler's row sums (logsumexp for logprobs, softmax for top-p) must not follow that, or a speculative
    verify (several rows of one request) and a large batch would change a request's logprobs and draws."""
    torch.manual_seed(0)
    n = 16
    logits = torch.randn(n, vocab_size) * 3
    logits[:, :50] += 12  # a peaked head, as a trained model's logits have
    rows = dict(temperature=[0.9] * n, top_p=[0.8] * n, seeds=list(range(n)), positions=[5] * n)
    batch = sample(logits, make(vocab_size, n, max_num_logprobs=3, **rows))
    for i in range(n):
        one = {k: v[i : i + 1] for k, v in rows.items()}
        alone = sample(logits[i : i + 1], make(vocab_size, 1, max_num_logprobs=3, **one))
        assert alone.token_ids[0] == batch.token_ids[i]
        assert torch.equal(alone.logprobs[0], batch.logprobs[i]), i
        assert torch.equal(alone.top_logprobs[0], batch.top_logprobs[i]), i
    cumsum = row_softmax(logits).cumsum(-1)
    assert all(torch.equal(row_softmax(logits[i : i + 1]).cumsum(-1)[0], cumsum[i]) for i in range(n))
