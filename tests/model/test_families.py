"""Every family of model/families.py against transformers' own model of it: tiny random models whose dims hit
the edge cases (explicit head_dim, a window shorter than the prompt, per-layer windows and RoPE bases, NoPE
layers, tied and untied heads, Granite's scalars, Gemma 2's soft-caps), float32 on both CPU paths."""

import pytest
import torch

from model.config import ModelConfig
from model.families import FAMILIES
from model.kv_cache import KVCache
from tests.helpers.tiny_models import (
    ARCHES,
    ARCHITECTURES,
    FAMILY_OVERRIDES,
    TINY_NAMES,
    CpuPath,
    cache_blocks,
    reference_model,
    tiny_family,
    tokens_together_and_alone,
)

PROMPT = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()  # > every window
START = 20  # the greedy runs' prompt: past Phi-3's 16 (transformers recomputes the cache when a sequence
# outgrows LongRoPE's original length; kvserve picks the long factors from a request's start)


def test_every_family_has_a_tiny_model():
    """A family added to model/families.py needs a short name in tests/helpers/tiny_models.py (transformers' class
    of the same name builds it), or every test above would fail to build it."""
    assert set(FAMILIES) <= set(TINY_NAMES), set(FAMILIES) - set(TINY_NAMES)


def reference(path):
    return reference_model(path)


def cache_for(config, device: str = "cpu"):
    return KVCache(config, cache_blocks(config, 16), 4, torch.float32, device)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ARCHES)
def test_logits_match_transformers(tiny_model_factory, cpu_path, arch):
    path = tiny_family(tiny_model_factory, arch)
    model, config = cpu_path.load(path)
    ours = cpu_path.run(model, cache_for(config), PROMPT, 0, list(range(16)))
    with torch.no_grad():
        ref = reference(path)(torch.tensor([PROMPT])).logits[0]
    err = (ours - ref).abs().max().item()
    print(f"{arch}: max abs logit error {err:.2e} over {len(PROMPT)} positions")
    assert err < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
@pytest.mark.parametrize("arch", ARCHES)
def test_the_gpus_attention_matches_transformers_on_the_cpu(tiny_model_factory, arch, attention, triton_here):
    """What a GPU runs (server/engine/backend.py's CudaBackend: PyTorch ops, and attention by the Triton kernel that
    reads the cache in place, or torch's fused SDPA over the blocks gathered by table), run here on the CPU in
    float32 (the kernel under Triton's interpreter): the reference's logits, so that on a GPU only the device's
    arithmetic differs. The prompt goes in two chunks, the second reading the first's K/V from the cache as a GPU
    step would."""
    ours, ref = gpu_path_logits(tiny_family(tiny_model_factory, arch), attention, "cpu")
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
@pytest.mark.parametrize("arch", ARCHES)
def test_the_gpus_path_on_a_gpu_matches_transformers(tiny_model_factory, arch, attention):
    """The test above on the device itself, float32 (tl.dot in IEEE precision, no TF32): the kernels compiled
    there, the cache and the model's ops on the GPU, against transformers on the CPU. What differs from it is the
    device's arithmetic alone, so a family that fails here and passes above has code the GPU runs otherwise."""
    ours, ref = gpu_path_logits(tiny_family(tiny_model_factory, arch), attention, "cuda")
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def gpu_path_logits(path, attention: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the GPU's path's logits on `device`, the prompt in two chunks; transformers' on the CPU)."""
    gpu_path = CpuPath(kernels=False, gpu_attention=attention, device=device)
    model, config = gpu_path.load(path)
    cache = cache_for(config, device)
    first = gpu_path.run(model, cache, PROMPT[:START], 0, list(range(16)))
    rest = gpu_path.run(model, cache, PROMPT, START, list(range(16)))
    with torch.no_grad():
        return torch.cat((first, rest)), reference(path)(torch.tensor([PROMPT])).logits[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", [arch for arch in ARCHES if FAMILIES[ARCHITECTURES[arch]].moe])
def test_each_token_takes_the_references_experts(tiny_model_factory, arch):
    """Every sparse layer routes each token of the prompt to the experts transformers' router picks."""
    from model.moe import MoE

    path = tiny_family(tiny_model_factory, arch)
    model, config = CpuPath(kernels=False).load(path)
    chosen = []
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            route = layer.mlp.route
            layer.mlp.route = lambda x, route=route: chosen.append(route(x)[1].sort(-1).values) or route(x)
    CpuPath(kernels=False).run(model, cache_for(config), PROMPT, 0, list(range(16)))
    with torch.no_grad():
        router_logits = reference(path)(torch.tensor([PROMPT]), output_router_logits=True).router_logits
    top_k = config.moe.top_k
    expected = [logits.topk(top_k, dim=-1).indices.sort(-1).values for logits in router_logits]
    assert len(chosen) == len(expected) == sum(spec.ffn == "moe" for spec in config.layers) > 0
    for ours, theirs in zip(chosen, expected, strict=True):
        assert torch.equal(ours, theirs.view(ours.shape))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", [arch for arch in ARCHES if FAMILIES[ARCHITECTURES[arch]].moe])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sparse_layers_tokens_do_not_depend_on_their_batch(tiny_model_factory, arch, dtype):
    """On dense weights (model/moe.py's PyTorch loop), each token's output of every sparse layer is the same bits
    alone, in any slice of the step, as in the whole step: its router's and its shared expert's gate's scores
    too (a GEMM of a few rows, or a GEMV, may sum in another order than a bigger one)."""
    from model.linear import PlainLinear
    from model.loader import load_model
    from model.moe import MoE
    from model.transformer import Ops

    model, _ = load_model(tiny_family(tiny_model_factory, arch), dtype, "cpu",
                          Ops.with_kernels(PlainLinear(batch_invariant=True), None))  # fmt: skip
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    x = torch.randn(37, sparse[0].router.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(
        dtype
    )
    with torch.inference_mode():
        for ffn in sparse:
            whole = ffn(x)
            for size in (1, 2, 3, 5, 8, 13):
                parts = torch.cat([ffn(x[i : i + size]) for i in range(0, len(x), size)])
                assert torch.equal(parts, whole), size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ARCHES)
def test_32_greedy_tokens_match_transformers(tiny_model_factory, cpu_path, arch):
    path = tiny_family(tiny_model_factory, arch)
    model, config = cpu_path.load(path)
    with torch.no_grad():
        prompt = torch.tensor([PROMPT[:START]])
        out = reference(path).generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    expected = out[0, START:].tolist()
    cache, seq = cache_for(config), PROMPT[:START]
    logits = cpu_path.run(model, cache, seq, 0, list(range(16)))
    for _ in range(32):  # one token a step, through the cache: past every window
        seq.append(int(logits[-1].argmax()))
        logits = cpu_path.run(model, cache, seq, len(seq) - 1, list(range(16)))
    assert seq[START:] == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ARCHES)
def test_quantized_weights_give_the_dense_models_choices(tiny_model_factory, cpu_path, arch):
    """Every family on kvserve's quantized CPU GEMMs (8-bit groups of 32, as a GGUF's Q8_0): close to the dense
    float32 logits, and the same top token nearly everywhere."""
    from model.kernels import cpu_kernels
    from model.linear import PlainLinear
    from model.quant import QuantizedLinear

    path = tiny_family(tiny_model_factory, arch)
    logits = []
    for linear in (PlainLinear(), QuantizedLinear(cpu_kernels(), PlainLinear(), 8)):
        model, config = cpu_path.load(path, linear=linear)
        logits.append(cpu_path.run(model, cache_for(config), PROMPT, 0, list(range(16))))
    dense, quantized = logits
    err = ((quantized - dense).abs().mean() / dense.abs().mean()).item()
    agree = (quantized.argmax(-1) == dense.argmax(-1)).float().mean().item()
    print(f"{arch}: mean error {err:.2%} of the mean logit, top-1 agreement {agree:.0%}")
    # Qwen3.5's gates (sigmoid on attention's output, silu on DeltaNet's, L2-normed q and k) pass 8-bit rounding
    # on at about 2.5x a Llama block's rate in these tiny random models, from the first token on (5.1% measured)
    assert err < (0.06 if arch == "qwen3_5" else 0.05) and agree >= 0.85


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kernels", ["on", "off"])  # the C++ CPU kernels, PyTorch ops
def test_batched_equals_alone_through_the_engine(tiny_model_factory, arch, kernels):
    """Six prompts together (prefill chunks beside decodes, past every window) give each one's tokens alone
    (GPT-2 on PyTorch ops crashed here: as many KV heads as query heads left attention's output non-contiguous)."""
    together, alone = tokens_together_and_alone(tiny_family(tiny_model_factory, arch), kernels)
    assert together == alone


@pytest.mark.timeout(60)
def test_the_fused_loop_runs_only_the_blocks_it_computes(tiny_model_factory):
    from model.layer_stack import covers

    # RMSNorm before each branch (and after it: Gemma), q/k norms per head, SwiGLU or GeGLU, a window and
    # RoPE tables per layer (full or partial: Phi-3), an attention soft-cap; sparse experts (the C++ MoE FFN);
    # GPT-OSS's sinks, biased router and experts and clamped SwiGLU; the hybrids' DeltaNet layers and gated attention;
    # Gemma 4's layers of their own heads, shared K/V, value norms, per-layer inputs and layer scalars
    stacked = ("llama", "qwen2", "mistral", "ministral", "qwen3", "gemma2", "gemma3", "gemma4", "phi3")
    stacked += ("qwen3moe", "qwen2moe", "mixtral", "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_next")
    for arch in stacked:
        assert covers(ModelConfig.from_dir(tiny_family(tiny_model_factory, arch))), arch
    # a norm, a scale or a layer without RoPE (OLMoE's q/k norms over the projection, Granite MoE's scalars,
    # SmolLM3): what the C++ loop does not have
    for arch in sorted(set(ARCHES) - set(stacked)):
        assert not covers(ModelConfig.from_dir(tiny_family(tiny_model_factory, arch))), arch


@pytest.mark.timeout(30)
def test_gemma3_config_reads_the_same_in_both_dialects():
    """transformers 4.x (rope_theta, rope_local_base_freq, sliding_window_pattern) and 5.x (rope_parameters per
    layer type, layer_types) spellings of Gemma 3 270M's config."""
    base = {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "sliding_window": 512, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    }  # fmt: skip
    v4 = ModelConfig.from_dict(
        {
            **base,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": None,
            "sliding_window_pattern": 6,
        }
    )
    v5 = ModelConfig.from_dict(
        {
            **base,
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }
    )
    assert v4 == v5
    full = [i for i, layer in enumerate(v4.layers) if layer.window is None]
    assert full == [5, 11, 17]
    assert {layer.rope.theta for layer in v4.layers if layer.window} == {1e4}
    assert v4.layers[5].rope.theta == 1e6 and v4.attention_scale == 256**-0.5
    assert v4.norm_offset == 1.0 and v4.embedding_scale == 640**0.5 and v4.mlp == "geglu"


@pytest.mark.timeout(120)
def test_longrope_takes_one_factor_list_per_request(tiny_model_factory):
    """A request that may outgrow LongRoPE's original length (prompt + max_tokens > 16) rotates with the long
    factors from its first token; one that stays within it with the short ones, as transformers does there."""
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    path = tiny_family(tiny_model_factory, "phi3")
    prompt = PROMPT[:10]
    with torch.no_grad():  # 10 positions: transformers' short factors
        short = torch.log_softmax(reference(path)(torch.tensor([prompt])).logits[0, -1], -1)
    config = EngineConfig(kv_cache_memory=4 << 20, block_size=4, dtype="float32", kv_cache_dtype="float32")
    engine = Engine(str(path), config)

    def first_logprob(max_tokens):
        engine.add_request(
            f"r{max_tokens}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
        )
        outs = [out for out in engine.step() if out.logprobs]
        while engine.has_work():
            engine.step()
        return outs[0].logprobs[0]

    within, beyond = first_logprob(6), first_logprob(7)  # 10 + 6 = 16 stays within; 17 does not
    assert within.token_id == int(short.argmax())
    assert abs(within.logprob - short.max().item()) < 1e-4
    assert abs(beyond.logprob - within.logprob) > 1e-3 or beyond.token_id != within.token_id


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "truncate", [True, False]
)  # Qwen3's long-context configs leave it at True; GPT-OSS: False
def test_yarn_rope_scaling_matches_transformers(tiny_model_factory, cpu_path, truncate):
    """A Qwen3 given YaRN past 16 positions, as its model card's long-context config does, and with
    the ramp's ends not rounded (GPT-OSS's)."""
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}
    path = tiny_model_factory(
        "qwen3", **FAMILY_OVERRIDES["qwen3"], rope_parameters=yarn | {"truncate": truncate}
    )
    model, config = cpu_path.load(path)
    assert config.layers[0].rope.kind == "yarn"
    ours = cpu_path.run(model, cache_for(config), PROMPT, 0, list(range(16)))
    with torch.no_grad():
        ref = reference(path)(torch.tensor([PROMPT])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.timeout(30)
def test_unsupported_features_are_refused_by_name():
    from model.config import UnsupportedModelError

    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4,
    }  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        ModelConfig.from_dict(
            {**base, "sliding_window": 8, "layer_types": ["linear_attention", "full_attention"]}
        )
    gpt_oss = {**base, "architectures": ["GptOssForCausalLM"], "num_local_experts": 4}
    with pytest.raises(UnsupportedModelError, match="MXFP4 safetensors"):  # the released checkpoints' experts
        ModelConfig.from_dict({**gpt_oss, "quantization_config": {"quant_method": "mxfp4"}})
    assert ModelConfig.from_dict(gpt_oss).attn_sinks  # the same checkpoint dequantized loads
    with pytest.raises(UnsupportedModelError, match="'relu'"):
        ModelConfig.from_dict({**base, "hidden_act": "relu"})
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM"):  # the list of what is supported
        ModelConfig.from_dict({**base, "architectures": ["Phi3SmallForCausalLM"]})


@pytest.mark.timeout(30)
def test_qwen3_next_config_reads_the_same_in_both_dialects():
    """Qwen3-Next-80B-A3B's config.json (transformers 4.57's keys: full_attention_interval and no layer_types,
    rope_theta and partial_rotary_factor at the top) and 5.x's spelling of the same model (layer_types,
    rope_parameters): DeltaNet on three layers of four, a quarter of each head rotated, every FFN sparse."""
    base = {
        "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "max_position_embeddings": 262144, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "moe_intermediate_size": 512, "norm_topk_prob": True, "num_experts": 512, "num_experts_per_tok": 10,
        "shared_expert_intermediate_size": 512, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    }  # fmt: skip
    rope = {"rope_theta": 10000000, "partial_rotary_factor": 0.25}
    v4 = ModelConfig.from_dict(base | rope | {"full_attention_interval": 4, "rope_scaling": None})
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    v5 = ModelConfig.from_dict(
        base | {"layer_types": layer_types, "rope_parameters": rope | {"rope_type": "default"}}
    )
    assert v4 == v5
    assert v4.attention_layers == list(range(3, 48, 4)) and len(v4.linear_layers) == 36
    assert {layer.rope.dim for layer in v4.layers if layer.rope} == {64}
    assert all(layer.ffn == "moe" for layer in v4.layers)
    assert v4.moe.renormalize and v4.moe.shared_intermediate_size == 512 and v4.moe.top_k == 10
    assert v4.norm_offset == 1.0 and v4.attn_output_gate and v4.linear_attention.num_value_heads == 32
