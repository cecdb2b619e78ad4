"""A GGUF served in place with its own quantized weights: loaded as they are, computing what their dequantized
values do."""

import pytest
import torch
from gguf import GGMLQuantizationType

from model import cpu_tier
from model.kernels import cpu_kernels
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from tests.helpers.gguf_writers import tiny_hf_model, write_llama_cpp_gguf, write_tiny_gguf
from weights.gguf_source import GGUFSource


def engine_for(gguf, **config) -> Engine:
    return Engine(GGUFSource(gguf), EngineConfig(**{"kv_cache_memory": 8 << 20, "block_size": 4, **config}))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_quantized_gguf_computes_what_its_dequantized_weights_do(tmp_path, byte_vocab, type_name):
    from model.linear import Linear

    qtype = GGMLQuantizationType[type_name]
    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=qtype, tied=True)
    gguf = tmp_path / "tiny.gguf"
    dequantized = engine_for(gguf, quantization="none", dtype="float32")
    ids = list(range(3, 60))
    reference = dequantized.score(ids)
    # each tier's own activations (--gemm-activations wide): float32 ones as they are, or rounded to int16 per
    # group of 32 (AVX2, AMX; to 2047 levels for Q4_1 on AMX's tiles, 1e-2); by default, where the engine rounds
    # them to int8 per 32 (AVX2's float32 ones), 8 bits as bfloat16's
    float32 = 1e-3 if cpu_kernels().gemm_float32_as == "int16" else 1e-4
    if cpu_kernels().gemm_int16_narrow:
        float32 = 1e-2
    for dtype, activations in (("float32", "wide"), ("float32", "auto"), ("bfloat16", "auto")):
        quantized = engine_for(gguf, dtype=dtype, gemm_activations=activations)
        linears = [m for m in quantized.runner.model.modules() if isinstance(m, Linear)]
        int8 = any(getattr(m.method, "int8_activations", False) for m in linears)
        tolerance = float32 if dtype == "float32" and not int8 else 0.05
        bits = {m.bits for m in linears}
        assert bits == {8 if type_name == "Q8_0" else 4}  # every matrix of the tiny GGUF is in type_name
        assert all(m.weight.is_meta for m in linears)
        scores = quantized.score(ids)
        # close to the float32 reference, and the same most likely token nearly everywhere
        assert (scores - reference).abs().max() < tolerance * reference.abs().max(), dtype
        assert (scores.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tier", [t.name for t in cpu_tier.runnable()])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_requests_are_batch_invariant(tmp_path, byte_vocab, tier, dtype):
    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=GGMLQuantizationType.Q4_1)
    engine = engine_for(tmp_path / "tiny.gguf", max_num_batched_tokens=24, dtype=dtype, cpu_tier=tier)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = {f"p{i}": list(range(5 + i, 40 + 3 * i)) for i in range(6)}

    def run(group: dict) -> dict:
        for rid, ids in group.items():
            engine.add_request(rid, ids, params)
        tokens = {rid: [] for rid in group}
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        return tokens

    together = run(prompts)
    alone = {rid: run({rid: ids})[rid] for rid, ids in prompts.items()}
    assert together == alone
    assert engine.stats().kv_cache_usage == 0


def greedy(engine: Engine, prompts: dict, max_tokens: int = 16) -> dict:
    """Each request's greedy tokens and their logprobs (the bits of its logits, not only their argmax)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    tokens = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += [(t.token_id, t.logprob) for t in out.logprobs]
    return tokens


@pytest.mark.timeout(60)
def test_a_steps_prompt_rows_are_its_prompt_tokens_in_runs():
    """The rows the amx tier's prompt GEMMs take (ModelRunner._prompt_runs): a decode's and its drafts' none, a
    prompt chunk's all, a preempted request's recomputed chunk only its prompt part; adjacent runs merged."""
    from server.engine.model_runner import ModelRunner
    from server.engine.request_state import Request
    from server.engine.scheduler import ScheduledChunk

    def request(prompt_len: int, generated: int) -> Request:
        r = Request("r", list(range(prompt_len)), SamplingParams())
        r.output_token_ids.extend(range(generated))
        return r

    decode = ScheduledChunk(request(5, 3), 7, 3, True, False, drafts=[1, 2])  # its last token and two drafts
    prompt = ScheduledChunk(request(20, 0), 8, 12, True, False)  # the prompt's last 12 tokens
    recomputed = ScheduledChunk(request(6, 4), 0, 10, True, False)  # 6 prompt tokens, then 4 generated
    other = ScheduledChunk(request(9, 0), 0, 4, False, False)  # a prompt's first 4 of 9
    chunks = [decode, prompt, recomputed, other]
    starts = [0, 3, 15, 25]
    runs = ModelRunner._prompt_runs(chunks, starts)
    assert runs.tolist() == [[3, 21], [25, 29]]
    assert ModelRunner._prompt_runs([decode], [0]) is None


amx_only = pytest.mark.skipif(
    "amx" not in [t.name for t in cpu_tier.runnable()], reason="AMX: Xeons that have its tiles"
)


@pytest.mark.timeout(300)
@amx_only
@pytest.mark.parametrize("family", ["llama", "qwen2moe"])  # dense; experts routed and shared
def test_amx_prompt_gemms_keep_every_tokens_bits_its_own(tmp_path, byte_vocab, family):
    """On the amx tier a prompt's tokens run their GEMMs on the weights dequantized to bfloat16 (--prefill-gemms
    auto), generated ones on the exact kernels. Each token's output still depends on nothing else: requests
    batched and chunked as they come give what each gives alone; preempted and recomputed, what it gives
    unpreempted; and a prompt that repeats another request's prompt and output gives what it gives on a fresh
    engine (the blocks of generated tokens are no prompt's hit). The prompt's scores are close to the exact
    kernels' and not the same bits (the prompt GEMMs did run)."""
    from model.kv_cache import KVCache
    from model.moe import MoE

    gguf = tmp_path / "tiny.gguf"
    if family == "llama":
        write_tiny_gguf(gguf, byte_vocab, qtype=GGMLQuantizationType.Q4_1)
    else:
        tiny_hf_model(family, len(byte_vocab["tokens"])).save_pretrained(tmp_path / "hf")
        write_llama_cpp_gguf(tmp_path / "hf", gguf, byte_vocab, GGMLQuantizationType.Q8_0)
    engine = engine_for(gguf, max_num_batched_tokens=24, cpu_tier="amx")
    model = engine.runner.model
    assert model.layer_stack is not None
    assert any(isinstance(m, MoE) for m in model.modules()) == (family != "llama")
    exact = engine_for(gguf, max_num_batched_tokens=24, cpu_tier="amx", prefill_gemms="exact")
    assert engine.runner.prompt_gemms and not exact.runner.prompt_gemms
    ids = list(range(3, 60))
    scores, reference = engine.score(ids), exact.score(ids)
    assert not torch.equal(scores, reference)
    assert (scores - reference).abs().max() < 0.05 * reference.abs().max()

    prompts = {f"p{i}": list(range(5 + i, 40 + 3 * i)) for i in range(6)}
    together = greedy(engine, prompts)
    alone = {rid: greedy(engine, {rid: ids})[rid] for rid, ids in prompts.items()}
    assert together == alone

    per_block = KVCache.bytes_per_block(engine.model_config, 4, engine.runner.kv_cache.k.dtype)
    tight = engine_for(gguf, max_num_batched_tokens=24, cpu_tier="amx", kv_cache_memory=30 * per_block)
    assert greedy(tight, prompts) == together
    assert tight.stats().num_preemptions > 0

    follow_up = {"again": prompts["p0"] + [t for t, _ in together["p0"]] + [7, 8, 9]}
    assert greedy(engine, follow_up) == greedy(engine_for(gguf, cpu_tier="amx"), follow_up)
    assert engine.stats().kv_cache_usage == 0


@pytest.mark.timeout(120)
def test_quantization_that_cannot_run_is_refused_by_name(tmp_path, byte_vocab):
    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=GGMLQuantizationType.Q4_1)
    gguf = tmp_path / "tiny.gguf"
    with pytest.raises(ValueError, match="float32 or bfloat16 activations, not float16"):
        engine_for(gguf, quantization="int4", dtype="float16")
    with pytest.raises(ValueError, match="unknown --quantization"):
        engine_for(gguf, quantization="int3")
    # auto with float16 serves the same file dequantized (and says so in the log)
    model = engine_for(gguf, dtype="float16").runner.model
    assert model.lm_head.weight.dtype == torch.float16 and not model.lm_head.weight.is_meta


@pytest.mark.timeout(60)
def test_on_a_gpu_quantized_weights_stay_quantized_where_triton_is_here(
    tmp_path, byte_vocab, monkeypatch, caplog
):
    """On CUDA a GGUF's weights stay quantized, on the Triton GEMM (model/linear_triton.py); without Triton the
    same file is served dense (bfloat16 at load) with a warning that says why, and asking for a quantized format
    is refused by name. Decided before any tensor reaches the device, so it is checked here without one."""
    import server.engine.backend
    from model.linear import PlainLinear
    from model.linear_triton import TritonQuantLinear
    from server.engine.backend import CudaBackend, WeightFormat, select_quantization

    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=GGMLQuantizationType.Q4_1)
    source = GGUFSource(tmp_path / "tiny.gguf")
    cuda = torch.device("cuda")
    backend = CudaBackend.create(EngineConfig(), source, cuda)
    assert backend.weights is WeightFormat.STORED and backend.dtype == torch.bfloat16
    linear = backend.ops.linear
    assert isinstance(linear, TritonQuantLinear) and linear.bits is None and linear.dtype == torch.bfloat16
    assert type(linear.dense) is PlainLinear and linear.device == cuda
    # --quantization int8 quantizes the weights no file keeps quantized at load, onto the same kernel
    int8 = CudaBackend.create(EngineConfig(quantization="int8"), source, cuda)
    assert int8.weights is WeightFormat.INT8 and int8.ops.linear.bits == 8
    monkeypatch.setattr(server.engine.backend, "triton_missing", lambda: "Triton is not installed")
    with caplog.at_level("WARNING"):
        dense = CudaBackend.create(EngineConfig(), source, cuda)
    assert dense.weights is WeightFormat.DENSE and not dense.ops.linear.keeps_quantized
    assert (
        "dequantized: Triton is not installed" in caplog.text
    )  # the loader dequantizes what it does not keep
    with pytest.raises(ValueError, match="--quantization int4: Triton is not installed"):
        CudaBackend.create(EngineConfig(quantization="int4"), source, cuda)
    # where the quantized GEMMs run (why_not None): the file's own types, or dense weights quantized at load
    assert select_quantization("auto", source, None) == WeightFormat.STORED
    assert select_quantization("int4", source, None).quantize_to == 4
    assert select_quantization("none", source, None) == WeightFormat.DENSE


@pytest.mark.timeout(180)
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_a_quantized_gguf_on_the_gpus_path_computes_what_its_dequantized_weights_do(
    tmp_path, byte_vocab, type_name, triton_here
):
    """What a GPU runs for a GGUF (server/engine/backend.py's CudaBackend): its weights kept quantized and
    multiplied by the Triton GEMM (model/linear_triton.py), attention by the Triton kernel, here on the CPU in
    float32 under Triton's interpreter: the logits of the same file dequantized, on PyTorch's own ops."""
    from model.kv_cache import KVCache
    from model.linear import Linear, PlainLinear
    from model.linear_triton import TritonQuantLinear
    from tests.helpers.tiny_models import CpuPath, cache_blocks

    write_tiny_gguf(tmp_path / "tiny.gguf", byte_vocab, qtype=GGMLQuantizationType[type_name], tied=True)
    source = GGUFSource(tmp_path / "tiny.gguf")
    gpu_path, plain_path = CpuPath(kernels=False, gpu_attention="triton"), CpuPath(kernels=False)
    model, config = gpu_path.load(
        source, linear=TritonQuantLinear(torch.device("cpu"), torch.float32, PlainLinear())
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert {m.bits for m in linears} == {8 if type_name == "Q8_0" else 4} and all(
        m.weight.is_meta for m in linears
    )
    reference, _ = plain_path.load(GGUFSource(tmp_path / "tiny.gguf"))
    prompt = list(range(3, 40))

    def cache():
        return KVCache(config, cache_blocks(config, 16), 4, torch.float32, "cpu")

    ours = gpu_path.run(model, cache(), prompt, 0, list(range(16)))
    want = plain_path.run(reference, cache(), prompt, 0, list(range(16)))
    assert (ours - want).abs().max() < 1e-4 * want.abs().max()
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "granitemoe"])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_a_ggufs_quantized_experts_are_grouped_as_the_file_holds_them(tmp_path, byte_vocab, family, type_name,
                                                                      triton_here):  # fmt: skip
    """A MoE GGUF read in place on the GPU's path (Triton's quantized GEMM, attention and grouped experts, under the
    interpreter): every sparse layer's experts grouped in the file's format, each expert's tensors views of the
    stack, and the logits those of the same quantized experts run by the loop over experts."""
    from model.kv_cache import KVCache
    from model.linear import PlainLinear
    from model.linear_triton import DeviceSegment, TritonQuantLinear
    from tests.helpers.gguf_writers import prompt_ids
    from tests.helpers.tiny_models import CpuPath, cache_blocks
    from tests.model.test_moe_triton import sparse_layers
    from tests.weights.test_gguf_in_place import write_moe_gguf
    from weights.gguf_source import GGUFSource

    gguf = write_moe_gguf(tmp_path, byte_vocab, family, type_name)
    bits = 8 if type_name == "Q8_0" else 4
    logits = {}
    for path in (CpuPath(kernels=False, gpu_attention="triton"), CpuPath(kernels=False)):
        linear = TritonQuantLinear(torch.device("cpu"), torch.float32, PlainLinear())
        model, config = path.load(GGUFSource(gguf), linear=linear)
        for layer in sparse_layers(model):
            assert {e.up.bits for e in layer.experts} == {bits}
            if path.gpu_attention is None:
                assert layer.grouped is None
                continue
            runs = layer.grouped.up.runs + layer.grouped.down.runs
            assert all(isinstance(r, DeviceSegment) and r.quantized.bits == bits for r in runs)
            stacked = layer.grouped.down.runs[0].quantized.q
            assert all(e.down.segments[0].quantized.q.data_ptr() == stacked[i].data_ptr()
                       for i, e in enumerate(layer.experts))  # fmt: skip
        ids = prompt_ids(config.vocab_size)[0].tolist()
        cache = KVCache(config, cache_blocks(config, 64), 4, torch.float32, "cpu")
        logits[path.gpu_attention] = path.run(model, cache, ids, 0, list(range(16)))
    grouped, looped = logits["triton"], logits[None]
    assert (grouped - looped).abs().max() <= 1e-4 * looped.abs().max()
    assert torch.equal(grouped.argmax(-1), looped.argmax(-1))
