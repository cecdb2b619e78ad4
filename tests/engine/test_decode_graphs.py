"""server/engine/decode_graphs.py. On the CPU its steps run eagerly on the graphs' own input tensors (capture=False):
a step of n decodes padded to its bucket gives each sequence what the plain step gives, and the padded rows write
only the block kept back for them. The graphs themselves are recorded and replayed in the `cuda` test."""

import pytest
import torch

from model.kv_cache import KVCache
from server.engine.config import EngineConfig
from tests.helpers.tiny_models import CpuPath, tiny_family

BLOCK, PER_SEQ = 4, 4  # tokens a block; blocks each sequence holds in each KV group


@pytest.mark.timeout(300)
# one KV group; windowed and full groups, soft-caps; groups of two head shapes (a strided cache), layers that read
# another's K/V, per-layer inputs; sparse layers with their experts grouped on the device (a shared expert too);
# Gated DeltaNet layers, whose padded rows' state goes to the cache's spare slot
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma4", "qwen2moe", "qwen3_5"])
def test_a_padded_decode_step_gives_each_sequence_the_plain_steps_hidden_states(
    tiny_model_factory, family, triton_here
):
    from model.attention_triton import TritonAttention
    from model.deltanet import StepStates
    from server.engine.decode_graphs import DecodeGraphs

    model, config = CpuPath(kernels=False, gpu_attention="triton").load(
        tiny_family(tiny_model_factory, family)
    )
    groups = len(config.kv_groups)
    hybrid = bool(config.linear_layers)
    cache = KVCache(
        config, 3 * groups * PER_SEQ + 2, BLOCK, torch.float32, "cpu", num_state_slots=3, num_spare_slots=1
    )
    assert cache.spare_state_slot == (3 if hybrid else None)
    attention = TritonAttention.for_model(config, BLOCK, "cpu")
    graphs = DecodeGraphs(model, cache, attention, max_batch=3, max_blocks=PER_SEQ, capture=False)
    assert graphs.buckets == [1, 2, 4] and graphs.scratch == cache.num_blocks - 1
    many = DecodeGraphs(model, cache, attention, max_batch=512, max_blocks=PER_SEQ, capture=False)
    assert (
        many.buckets[-1] == 256 and len(set(many.buckets)) == len(many.buckets) and many.bucket(257) is None
    )
    assert DecodeGraphs(model, cache, attention, max_batch=20, max_blocks=1, capture=False).buckets[-2:] == [
        16,
        24,
    ]
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 13]  # the prompts; a decode step then grows each by one
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]
    tables = [
        [[(i * groups + k) * PER_SEQ + j for j in range(PER_SEQ)] for k in range(groups)] for i in range(3)
    ]
    # the cache's tensors: K and V, and a hybrid's DeltaNet states (each sequence i's in slot i)
    pools = (cache.k, cache.v, *((cache.conv, cache.recurrent) if hybrid else ()))

    def restore(saved):
        for pool, values in zip(pools, saved, strict=True):
            pool.copy_(values)

    with torch.inference_mode():
        for i, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
            positions, meta = attention.build([len(prompt)], [len(prompt)], [table])
            states = StepStates([0], [len(prompt)], [i], [0]) if hybrid else None
            model(torch.tensor(prompt), positions, meta, cache, None, states)
        before = [p.clone() for p in pools]
        ids, seq_lens = [7, 8, 9], [n + 1 for n in lens]
        positions, meta = attention.build([1, 1, 1], seq_lens, tables)
        states = StepStates([0, 1, 2], [1, 1, 1], [0, 1, 2], lens) if hybrid else None
        plain = model(torch.tensor(ids), positions, meta, cache, None, states)
        after_plain = [p.clone() for p in pools]
        restore(before)
        padded = graphs.run(ids, seq_lens, tables, [0, 1, 2] if hybrid else [])  # bucket 4: one padded row
    assert padded.shape == plain.shape
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)
    if hybrid:  # the sequences' states as the plain step left them; the padded row's in the spare slot
        for ours, theirs in zip(pools[2:], after_plain[2:], strict=True):
            torch.testing.assert_close(ours[:, :3], theirs[:, :3], rtol=1e-5, atol=1e-5)
            assert ours[:, 3].abs().sum() > 0
    # every block but the kept-back one: the same K/V (slots are the pool's dimension 2, or 1 where it is strided)
    slots = (slice(None),) * (2 if config.uniform_kv else 1) + (slice(0, graphs.scratch * BLOCK),)
    for ours, theirs in zip((cache.k, cache.v), after_plain[:2], strict=True):
        torch.testing.assert_close(ours[slots], theirs[slots], rtol=1e-5, atol=1e-5)
    scratch = slots[:-1] + (slice(graphs.scratch * BLOCK, None),)
    assert cache.k[scratch].abs().sum() > 0  # the padded row's K went there
    # a batch of two fills bucket 2 exactly; a sequence alone, bucket 1
    with torch.inference_mode():
        restore(before)
        pair = graphs.run(ids[:2], seq_lens[:2], tables[:2], [0, 1] if hybrid else [])
    torch.testing.assert_close(pair, plain[:2], rtol=1e-5, atol=1e-5)
    # under async scheduling, rows 0 and 2 take the ids the step before drew, on the device
    with torch.inference_mode():
        restore(before)
        fed = (torch.tensor([0, 2]), torch.tensor([ids[0], ids[2]]))
        from_device = graphs.run([0, ids[1], 0], seq_lens, tables, [0, 1, 2] if hybrid else [], fed)
    torch.testing.assert_close(from_device, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_graphs_only_where_every_op_of_a_decode_step_can_be_recorded(tiny_model_factory, triton_here):
    """The CPU backend records none; a GPU run asked for --enforce-eager neither (decided before any capture); and
    the models whose steps read the host or carry other metadata run eagerly, saying why."""

    from model.attention import TorchAttention
    from model.attention_triton import TritonAttention
    from model.linear import PlainLinear
    from model.linear_triton import TritonQuantLinear
    from server.engine.backend import CpuBackend, CudaBackend, select_backend
    from server.engine.decode_graphs import why_not_graphed

    llama = tiny_family(tiny_model_factory, "llama")
    cpu = select_backend(EngineConfig(device="cpu"), llama)
    assert isinstance(cpu, CpuBackend) and cpu.decode_graphs(None, None, None, EngineConfig()) is None
    gpu = CudaBackend.create(EngineConfig(), llama, torch.device("cuda"))
    assert gpu.decode_graphs(None, None, None, EngineConfig(enforce_eager=True)) is None
    triton = TritonAttention(16, 4, [2], "cpu")
    expected = {"llama": None, "gemma2": None, "gemma4": None, "qwen3moe": None, "qwen3_5": None,
                "phi3": "LongRoPE"}  # fmt: skip
    for family, why in expected.items():
        model, _ = CpuPath(kernels=False, gpu_attention="triton").load(
            tiny_family(tiny_model_factory, family)
        )
        reason = why_not_graphed(model, triton)
        assert reason is None if why is None else reason.startswith(why), (family, reason)
        assert why_not_graphed(model, TorchAttention(16, 2, 8)) == "attention is not the Triton kernel"
    # experts quantized on the device (a GGUF's, or quantized at load) are grouped too
    quantized, _ = CpuPath(kernels=False, gpu_attention="triton").load(
        tiny_family(tiny_model_factory, "qwen3moe"), linear=TritonQuantLinear(torch.device("cpu"), torch.float32,
                                                                              PlainLinear(), bits=4)
    )  # fmt: skip
    assert all(e.up.bits == 4 for e in quantized.layers[0].mlp.experts)
    assert why_not_graphed(quantized, triton) is None
    # experts left to PyTorch's loop (a kernel off on that device) read their counts on the host; DeltaNet
    # layers that run a step's sequences one by one read their places in it on the host
    looped, _ = CpuPath(kernels=False).load(tiny_family(tiny_model_factory, "qwen3moe"))
    assert why_not_graphed(looped, triton).startswith("MoE layers whose experts run PyTorch's loop")
    looped, _ = CpuPath(kernels=False).load(tiny_family(tiny_model_factory, "qwen3_5"))
    assert why_not_graphed(looped, triton).startswith("Gated DeltaNet layers that run a step's sequences one")


@pytest.mark.cuda
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma4", "qwen3moe", "qwen3_5"])
def test_decode_steps_replayed_from_cuda_graphs_give_the_eager_steps_tokens(tiny_model_factory, family):
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    path = str(tiny_family(tiny_model_factory, family))
    results, stats = [], []
    # graphed and eager under async scheduling (the GPU's default), then graphed with each step read back at once
    for eager, overlap in ((False, True), (True, True), (False, False)):
        config = EngineConfig(device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=8,
                              enforce_eager=eager, async_scheduling=overlap)  # fmt: skip
        engine = Engine(path, config)
        g = torch.Generator().manual_seed(1)
        for i in range(6):  # batches of 6 decodes: bucket 8, two padded rows
            prompt = torch.randint(3, 300, (5 + 7 * i,), generator=g).tolist()
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        results.append(tokens)
        stats.append(engine.runner.graph_stats())
    assert results[0] == results[1] == results[2]
    assert stats[0][0] > 0 and stats[0][0] >= stats[0][1]  # most decode steps replayed
    assert stats[1][0] == 0 and stats[1][1] > 0
