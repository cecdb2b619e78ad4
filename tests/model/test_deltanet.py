"""Gated DeltaNet's state (model/deltanet.py) and the slots that hold it (model/kv_cache.py, the block manager): a
prompt gives the same bits prefilled in one step or in chunks of any size, a sequence the same bits beside others
in a step as alone, a slot taken over by a new sequence starts from zero, and the engine serves a hybrid model with
its state slots given back; tests/engine/test_hybrid_state.py has its prefix cache and its drafts. Logits against
transformers for every family, Qwen3.5 included, are tests/model/test_families.py's."""

import pytest
import torch

from model.attention_cpu import CpuKernelAttention
from model.deltanet import CHUNK, StepStates
from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.linear import PlainLinear
from model.quant import QuantizedLinear
from tests.helpers.tiny_models import CpuPath, cache_blocks, tiny_family

BLOCK = 4


def load_hybrid(path, deltanet: str, dtype=torch.float32, quantized: bool = True):
    """The tiny Qwen3.5 on kvserve's quantized GEMMs and C++ attention (each row's bits its own in any batch), so
    that what differs between two runs can only be the DeltaNet layers' doing; their recurrence in C++ ("cpp",
    model/csrc/deltanet.cpp) or in PyTorch ops ("python")."""
    import dataclasses

    from model.loader import load_model
    from model.transformer import Ops

    linear = QuantizedLinear(cpu_kernels(), PlainLinear(), 8) if quantized else PlainLinear()
    ops = Ops.with_kernels(linear, cpu_kernels())
    if deltanet == "python":
        ops = dataclasses.replace(ops, gated_delta_net=None)
    return load_model(path, dtype, "cpu", ops)


@pytest.fixture(scope="module", params=["cpp", "python"])
def hybrid(tiny_model_factory, request):
    return load_hybrid(tiny_family(tiny_model_factory, "qwen3_5"), request.param)


def step(model, cache, seqs) -> list[torch.Tensor]:
    """One step of several sequences, each (token ids so far, how many are cached, state slot, block table): the
    logits of each one's new tokens."""
    attention = CpuKernelAttention(cpu_kernels(), BLOCK)
    new = [ids[cached:] for ids, cached, _, _ in seqs]
    positions, meta = attention.build(
        [len(n) for n in new], [len(ids) for ids, *_ in seqs], [[t] for *_, t in seqs]
    )
    starts = [sum(len(n) for n in new[:i]) for i in range(len(new))]
    states = StepStates(starts, [len(n) for n in new], [s for _, _, s, _ in seqs], [c for _, c, _, _ in seqs])
    with torch.inference_mode():
        hidden = model(torch.tensor([t for n in new for t in n]), positions, meta, cache, None, states)
        logits = model.compute_logits(hidden)
    return [logits[s : s + len(n)] for s, n in zip(starts, new, strict=True)]


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_cache(config, slots: int = 4, blocks: int = 64) -> KVCache:
    return KVCache(config, cache_blocks(config, blocks), BLOCK, torch.float32, "cpu", num_state_slots=slots)


def state_of(cache: KVCache, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.conv[:, slot].clone(), cache.recurrent[:, slot].clone()


@pytest.mark.timeout(120)
def test_chunks_of_any_size_give_one_steps_bits(hybrid):
    model, config = hybrid
    ids, table = prompt(37, 1), list(range(10))
    whole_cache = fresh_cache(config)
    whole = step(model, whole_cache, [(ids, 0, 2, table)])[0]
    for sizes in ([1] * 37, [5, 1, 13, 18], [36, 1]):
        cache, done, parts = fresh_cache(config), 0, []
        for n in sizes:
            parts += step(model, cache, [(ids[: done + n], done, 2, table)])
            done += n
        assert torch.equal(torch.cat(parts), whole), sizes
        assert all(
            torch.equal(a, b) for a, b in zip(state_of(cache, 2), state_of(whole_cache, 2), strict=True)
        )


@pytest.mark.timeout(120)
def test_a_sequence_beside_others_is_the_same_bits_as_alone(hybrid):
    model, config = hybrid
    a, b, c = prompt(20, 2), prompt(9, 3), prompt(14, 4)
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    alone = [
        step(model, fresh_cache(config), [(ids, 0, 0, t)])[0]
        for ids, t in zip((a, b, c), tables, strict=True)
    ]
    cache = fresh_cache(config)
    together = step(model, cache, [(a, 0, 3, tables[0]), (b, 0, 1, tables[1]), (c, 0, 0, tables[2])])
    assert all(torch.equal(x, y) for x, y in zip(together, alone, strict=True))
    # then each decodes a token, a prefill chunk beside them: still each one's own bits
    nxt = [ids + [7] for ids in (a, b)]
    together = step(model, cache, [(nxt[0], 20, 3, tables[0]), (nxt[1], 9, 1, tables[1])])
    for ids, slot, t, got in zip(nxt, (3, 1), tables[:2], together, strict=True):
        single = fresh_cache(config)
        step(model, single, [(ids[:-1], 0, slot, t)])
        assert torch.equal(step(model, single, [(ids, len(ids) - 1, slot, t)])[0], got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("before", [17, CHUNK - 2])  # within a chunk; across a chunk's end (its rows folded)
def test_a_step_keeps_the_state_after_each_token_where_asked(hybrid, before):
    """A decode verifying drafts asks for its state after each of its tokens but the last (StepStates.keep_each):
    slot keep_each + t holds the state the sequence has with only its first t + 1 tokens of the step computed,
    bit for bit, a sequence beside it untouched."""
    model, config = hybrid
    ids, table, other = prompt(before + 4, 12), list(range(8)), prompt(9, 13)
    cache = fresh_cache(config, slots=8)
    step(model, cache, [(ids[:before], 0, 0, table)])  # the sequence so far; then 4 tokens at once, each kept
    attention = CpuKernelAttention(cpu_kernels(), BLOCK)
    positions, meta = attention.build([4, 9], [before + 4, 9], [[table], [list(range(8, 16))]])
    states = StepStates([0, 4], [4, 9], [0, 1], [before, 0], keep_each=[4, -1])
    with torch.inference_mode():
        model(torch.tensor(ids[before:] + other), positions, meta, cache, None, states)
    for t in range(3):
        alone = fresh_cache(config, slots=8)
        step(model, alone, [(ids[:before], 0, 0, table)])
        step(model, alone, [(ids[: before + 1 + t], before, 0, table)])
        assert all(
            torch.equal(a, b) for a, b in zip(state_of(cache, 4 + t), state_of(alone, 0), strict=True)
        ), t
    assert state_of(cache, 7)[1].abs().sum() == 0  # no more than asked


@pytest.mark.timeout(120)
def test_a_slot_taken_over_starts_from_zero(hybrid):
    """A slot's last sequence left its state behind (a finished or preempted request): the next one's first chunk
    ignores it."""
    model, config = hybrid
    b, table = prompt(11, 6), list(range(8))
    used = fresh_cache(config)
    step(model, used, [(prompt(30, 5), 0, 1, table)])
    assert used.recurrent[:, 1].abs().sum() > 0
    assert torch.equal(
        step(model, used, [(b, 0, 1, table)])[0], step(model, fresh_cache(config), [(b, 0, 1, table)])[0]
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value_head_dim", [16, 32, 24])  # the kernel's column blocks: 16, 32, one at a time
def test_the_cpp_recurrence_is_the_python_ones(tiny_model_factory, dtype, value_head_dim):
    """model/csrc/deltanet.cpp against model/deltanet.py's loop, on a step of a prefill beside a decode, then the
    next step from the states each left, dense GEMMs around them: within float32's rounding (their exp functions
    differ in the last bit, their sums are fused or not), or for bfloat16 within a rounding of its own here and
    there."""
    from tests.helpers.tiny_models import FAMILY_OVERRIDES

    path = tiny_model_factory(
        "qwen3_5", **{**FAMILY_OVERRIDES["qwen3_5"], "linear_value_head_dim": value_head_dim}
    )
    runs = []
    for deltanet in ("cpp", "python"):
        model, config = load_hybrid(path, deltanet, dtype, quantized=False)
        cache = KVCache(config, cache_blocks(config, 64), BLOCK, dtype, "cpu", num_state_slots=4)
        a, b = prompt(23, 8), prompt(6, 9)
        first = step(model, cache, [(a, 0, 3, list(range(8))), (b, 0, 0, list(range(8, 16)))])
        second = step(
            model, cache, [(a + [5], 23, 3, list(range(8))), (b + [6, 7], 6, 0, list(range(8, 16)))]
        )
        runs.append(torch.cat([*first, *second]).float())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert (runs[0] - runs[1]).abs().max() < tolerance and runs[0].abs().mean() > 0.1


@pytest.mark.timeout(120)
def test_heads_that_forget_fast_keep_their_bits_and_the_reference(tiny_model_factory):
    """Decays of ~-30 a token (Qwen3.5's fast-forgetting heads reach -16) take a chunk's early keys' weights
    exp(G - G_j) far below float32's normal range, where the C++ delta rule flushes subnormals to zero
    (model/csrc/deltanet.cpp): a prompt still gives one step's bits prefilled in chunks, and the Python loop's
    logits within float32's rounding."""
    path = tiny_family(tiny_model_factory, "qwen3_5")
    ids, table = prompt(29, 5), list(range(10))
    logits = []
    for deltanet, quantized in (("cpp", True), ("cpp", False), ("python", False)):
        model, config = load_hybrid(path, deltanet, quantized=quantized)
        for layer in model.layers:
            if layer.linear:
                layer.attn.A_log.data.fill_(2.7)  # a decay rate of -exp(2.7) ~ -15
                layer.attn.dt_bias.data.fill_(2.0)  # times softplus(a + 2) ~ 2
        whole = step(model, fresh_cache(config), [(ids, 0, 2, table)])[0]
        if quantized:  # the GEMMs give a row the same bits in any batch: only DeltaNet could differ
            cache, done, parts = fresh_cache(config), 0, []
            for n in (3, 1, 11, 14):
                parts += step(model, cache, [(ids[: done + n], done, 2, table)])
                done += n
            assert torch.equal(torch.cat(parts), whole)
        else:
            logits.append(whole)
    assert (logits[0] - logits[1]).abs().max() < 1e-4 and logits[0].abs().mean() > 0.1


def test_the_cache_holds_kv_for_attention_layers_and_a_state_per_slot(hybrid):
    _, config = hybrid
    spec = config.linear_attention
    assert config.attention_layers == [3] and config.linear_layers == [0, 1, 2]
    cache = fresh_cache(config, slots=5)
    assert cache.k.shape == (1, config.num_kv_heads, 64 * BLOCK, config.head_dim)  # one attention layer's
    assert cache.conv.shape == (3, 5, spec.conv_kernel - 1, spec.conv_dim)
    # a head's S0, key_head_dim x value_head_dim, then a row [k | u | G] for each token of a chunk
    dk, dv = spec.key_head_dim, spec.value_head_dim
    assert cache.recurrent.shape == (3, 5, spec.num_value_heads, dk * dv + CHUNK * (dk + dv + 1))
    assert (
        cache.layer(3)[0].data_ptr() == cache.k[0].data_ptr()
        and cache.layer(1)[1].shape == cache.recurrent[1].shape
    )
    per_block = 2 * 1 * BLOCK * config.num_kv_heads * config.head_dim * 4
    assert KVCache.bytes_per_block(config, BLOCK, torch.float32) == per_block
    assert (
        KVCache.bytes_per_state_slot(config) == (cache.conv[:, 0].numel() + cache.recurrent[:, 0].numel()) * 4
    )


@pytest.mark.timeout(300)
def test_the_engine_serves_a_hybrid_with_its_slots_given_back(tiny_model_factory):
    """More requests than state slots (max_num_seqs 2): each gets its own tokens alone (with n-gram drafts and
    the prefix cache on), every slot comes back, an aborted request's too."""
    from server.engine.config import EngineConfig, SpeculativeConfig
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    config = EngineConfig(kv_cache_memory=4 << 20, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=2,
                          dtype="float32", batch_invariant=True, speculative=SpeculativeConfig(prompt_lookup_min=1))  # fmt: skip
    engine = Engine(str(tiny_family(tiny_model_factory, "qwen3_5")), config)
    assert engine.drafter is not None and engine.config.enable_prefix_caching
    assert engine.runner.kv_cache.num_state_slots == 2
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": prompt(5 + 7 * i, 10 + i) for i in range(5)}

    def run(batch, abort=None):
        tokens = {rid: [] for rid in batch}
        for rid, ids in batch.items():
            engine.add_request(rid, ids, params)
        steps = 0
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            steps += 1
            if abort and steps == 3:
                engine.abort(abort)
        return tokens

    together = run(prompts)
    assert together == {rid: run({rid: ids})[rid] for rid, ids in prompts.items()}
    run(prompts, abort="r1")
    manager = engine.scheduler.block_manager
    assert sorted(manager.free_state_slots) == [0, 1]
    assert all(r.state_slot is None for r in engine.scheduler.requests.values())
    # scoring a text (bench-quality's teacher forcing) fed in chunks of any size: the same logits
    text = prompt(30, 20)
    assert torch.equal(engine.score(text, chunk=7), engine.score(text, chunk=64))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path, family):
    """Qwen3.5 and Gemma 3 ship as image-text checkpoints (…ForConditionalGeneration: the text model's config under
    text_config, its weights under model.language_model, a vision tower beside): kvserve serves the text model
    with the logits transformers' whole model gives a text prompt."""
    import transformers

    from model.config import ModelConfig
    from tests.helpers.tiny_models import FAMILY_OVERRIDES, save_tiny_tokenizer, tiny_config

    torch.manual_seed(0)
    text = tiny_config(family, **FAMILY_OVERRIDES[family]).to_dict()
    if family == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
        # the text config says untied, the whole model's tied: transformers ties by the latter
        text["tie_word_embeddings"] = False
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=16, patch_size=4)  # fmt: skip
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    saved = ModelConfig.from_dir(tmp_path)  # tied as the whole model is, whatever text_config says
    assert saved.tie_word_embeddings == model.config.tie_word_embeddings
    assert (
        ModelConfig.from_dir(tmp_path).architecture
        == {"qwen3_5": "Qwen3_5ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    )
    ids = prompt(30, 7)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0]
    path = CpuPath(False)
    ours, config = path.load(tmp_path)
    got = path.run(
        ours, KVCache(config, cache_blocks(config, 64), BLOCK, torch.float32, "cpu"), ids, 0, list(range(16))
    )
    assert (got - want).abs().max() < 1e-4


@pytest.mark.timeout(60)
def test_qwen3_nexts_grouped_projections_regroup_as_transformers_splits_them():
    """Qwen3-Next's in_proj_qkvz and in_proj_ba (rows grouped by key head) regrouped as kvserve's one in_proj
    (model/loader.py's ungroup_qkvz_ba) give exactly the q, k, v, z, b, a transformers' layer splits them into.
    Integer weights and inputs: every product and sum exact, so any row out of place shows."""
    import transformers

    from model.config import ModelConfig
    from model.loader import ungroup_qkvz_ba
    from tests.helpers.tiny_models import FAMILY_OVERRIDES, tiny_config

    cfg = tiny_config("qwen3_next", **FAMILY_OVERRIDES["qwen3_next"] | dict(linear_num_value_heads=6))
    layer = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0)
    g = torch.Generator().manual_seed(0)
    for linear in (layer.in_proj_qkvz, layer.in_proj_ba):
        linear.weight.data = torch.randint(-3, 4, linear.weight.shape, generator=g).float()
    x = torch.randint(-3, 4, (1, 5, cfg.hidden_size), generator=g).float()
    with torch.no_grad():
        theirs = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
    spec = ModelConfig.from_dict(cfg.to_dict() | {"architectures": ["Qwen3NextForCausalLM"]}).linear_attention
    in_proj = ungroup_qkvz_ba(layer.in_proj_qkvz.weight, layer.in_proj_ba.weight, spec)
    sizes = (spec.key_dim,) * 2 + (spec.value_dim,) * 2 + (spec.num_value_heads,) * 2
    ours = (x[0] @ in_proj.T).split(sizes, dim=-1)
    for name, a, b in zip("qkvzba", ours, theirs, strict=True):
        assert torch.equal(a, b.reshape(a.shape)), name


@pytest.mark.timeout(180)
# tiled: value head h reads key head h % num_key_heads (llama.cpp's GGUF order), else h // group
@pytest.mark.parametrize("family,tiled", [("qwen3_5", False), ("qwen3_5", True), ("qwen3_next", False)])
# the recurrence in PyTorch ops, or as a GPU runs it: one Triton kernel (model/deltanet_triton.py, interpreted)
@pytest.mark.parametrize("recurrence", ["torch", "triton"])
def test_a_step_of_decodes_run_at_once_is_the_loops_arithmetic(
    tiny_model_factory, monkeypatch, family, tiled, recurrence, triton_here
):
    """A GPU's steps of decodes (Ops.parallel_deltanet: every sequence's token at once, on the device) against the
    loop a sequence at a time, float32: sequences at different places in their chunks, decoding across chunk
    ends (their rows folded into S0), one starting from nothing in a slot another left its state in, and one
    step whose decodes share it with a prompt (they still run together); the logits and the states they leave,
    to float32's rounding of sums in another order."""
    import dataclasses

    from model.deltanet import GatedDeltaNet
    from model.deltanet_triton import deltanet_decodes
    from model.loader import load_model
    from model.transformer import Ops

    path = tiny_family(tiny_model_factory, family)
    ops = dataclasses.replace(Ops.with_kernels(PlainLinear(), cpu_kernels()), gated_delta_net=None)
    looped, config = load_model(path, torch.float32, "cpu", ops)
    kernel = deltanet_decodes if recurrence == "triton" else None
    batched, _ = load_model(
        path, torch.float32, "cpu", dataclasses.replace(ops, parallel_deltanet=True, deltanet_decodes=kernel)
    )
    mixers = [layer.attn for model in (looped, batched) for layer in model.layers if layer.linear]
    for mixer in mixers:
        mixer.spec = dataclasses.replace(mixer.spec, tiled_value_heads=tiled)
    assert mixers and mixers[0].spec.num_value_heads > mixers[0].spec.num_key_heads  # heads in groups
    calls = []
    original = GatedDeltaNet._decodes
    monkeypatch.setattr(GatedDeltaNet, "_decodes", lambda self, *a: calls.append(1) or original(self, *a))
    prompts = [prompt(n, 20 + n) for n in (5, 11, 16)]
    tables = [list(range(12 * i, 12 * i + 12)) for i in range(5)]
    caches = [fresh_cache(config, slots=5), fresh_cache(config, slots=5)]
    for cache in caches:  # a state left in slot 4, which the fourth sequence then starts from nothing in
        step(looped, cache, [(prompt(9, 40), 0, 4, tables[3])])
    seqs = [[ids, 0, slot, t] for ids, slot, t in zip(prompts, (2, 0, 1), tables[:3], strict=True)]
    for model, cache in zip((looped, batched), caches, strict=True):  # the prompts: not a step of decodes
        step(model, cache, [tuple(s) for s in seqs])
    for s in seqs:
        s[1] = len(s[0])
    seqs.append([[], 0, 4, tables[3]])
    for t in range(2 * CHUNK + 3):
        for s in seqs:
            s[0] = s[0] + [3 + (7 * t + len(s[0])) % 290]
        if t == 3:  # a prompt joins this step (slot 3): the others' decodes still run together
            seqs.append([prompt(10, 41), 0, 3, tables[4]])
        calls.clear()
        want = step(looped, caches[0], [tuple(s) for s in seqs])
        assert not calls
        got = step(batched, caches[1], [tuple(s) for s in seqs])
        assert len(calls) == len(config.linear_layers)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
        for s in seqs:
            s[1] = len(s[0])
    for ids, _, slot, _ in seqs:
        theirs = live_state(caches[0], config, slot, len(ids))
        for a, b in zip(live_state(caches[1], config, slot, len(ids)), theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(180)
# one: a block solved at a time (a step of many long prompts)
@pytest.mark.parametrize("span", ["all", "one"])
@pytest.mark.parametrize(
    "forgetting", ["slow", "fast"]
)  # fast: heads whose decay empties S within a few tokens
def test_a_gpus_prompts_in_blocks_are_the_loops_arithmetic(tiny_model_factory, forgetting, span, monkeypatch):
    """A GPU's prompt chunks (Ops.parallel_deltanet: the step's prompts together, in blocks of BLOCK positions from
    their chunks' starts, the blocks' corrections solved at once, all of them or a span at a time) against the loop
    a token at a time, float32: a prompt prefilled in pieces that start mid-chunk and cross blocks, beside a
    shorter one and a third in a slot another sequence left its state in, then beside the second's next piece,
    both across a block's end from different places in their chunks; the logits and the states they leave, to
    float32's rounding of sums in another order."""
    import dataclasses

    from model.deltanet import BLOCK

    if span == "one":
        monkeypatch.setattr("model.deltanet.SEQUENCE_BLOCKS", 1)
    from model.loader import load_model
    from model.transformer import Ops

    path = tiny_family(tiny_model_factory, "qwen3_5")
    ops = dataclasses.replace(Ops.with_kernels(PlainLinear(), cpu_kernels()), gated_delta_net=None)
    looped, config = load_model(path, torch.float32, "cpu", ops)
    blocked, _ = load_model(path, torch.float32, "cpu", dataclasses.replace(ops, parallel_deltanet=True))
    if forgetting == "fast":
        for model in (looped, blocked):
            for layer in model.layers:
                if layer.linear:
                    layer.attn.A_log.add_(3.0)
    caches = [fresh_cache(config, slots=4, blocks=128), fresh_cache(config, slots=4, blocks=128)]
    long, other, third = prompt(2 * BLOCK + 22, 30), prompt(2 * BLOCK + 2, 31), prompt(CHUNK + 1, 32)
    tables = [list(range(0, 40)), list(range(40, 80)), list(range(80, 84))]
    for model, cache in zip((looped, blocked), caches, strict=True):
        step(model, cache, [(prompt(12, 33), 0, 3, tables[2])])  # a state left in slot 3
    pieces = [3, BLOCK + 7, BLOCK + 12]  # 3, then from mid-chunk across a block's end, then the rest
    done = 0
    for i, n in enumerate(pieces):
        seqs = [(long[: done + n], done, 0, tables[0])]
        if i == 1:  # the second's first 61 tokens, the third's all
            seqs += [(other[: BLOCK - 3], 0, 1, tables[1]), (third, 0, 3, tables[2])]
        if i == 2:  # the second's rest: from 5 rows into a chunk, across a block's end
            seqs += [(other, BLOCK - 3, 1, tables[1])]
        got = step(blocked, caches[1], seqs)
        want = step(looped, caches[0], seqs)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
        done += n
    assert done == len(long)
    for slot, length in ((0, len(long)), (1, len(other)), (3, len(third))):
        theirs = live_state(caches[0], config, slot, length)
        for a, b in zip(live_state(caches[1], config, slot, length), theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def live_state(cache: KVCache, config, slot: int, length: int) -> list[torch.Tensor]:
    """What a sequence of `length` tokens reads of its state: its convolution inputs, S0 and its chunk's rows so
    far (rows past them hold older values, never read)."""
    from model.deltanet import split_state

    spec = config.linear_attention
    state = cache.recurrent[:, slot].contiguous()  # [layers, Hv, width]: split_state takes [heads, width]
    S0, keys, corrections, log_decays = split_state(state, spec.key_head_dim, spec.value_head_dim)
    m = length % CHUNK
    return [cache.conv[:, slot], S0, keys[..., :m], corrections[:, :m], log_decays[..., :m]]
