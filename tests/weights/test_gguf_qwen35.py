"""Qwen3.5/3.6 from GGUF (`qwen35`, and `qwen35moe` here too): llama.cpp's own converter writes a tiny random
Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers with fewer key heads than value heads, so their value heads are
stored tiled; gated attention with partial rotary; +1 baked into every norm but DeltaNet's gated one; ssm_a =
-exp(A_log)), and kvserve serves the file in place with transformers' logits on the folder it came from. Its Q8_0
file keeps every matrix quantized on the kernels, ssm_out's columns reordered block by block, and gives the logits
of that model with those values."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.linear import Linear, PlainLinear
from model.quant import QuantizedLinear
from tests.helpers.gguf_writers import TinyFamily, prompt_ids, tiny_hf_model
from tests.helpers.tiny_models import CpuPath
from tests.weights.test_gguf_llama_cpp import DRIVER, llama_cpp_tree  # noqa: F401 (a fixture)
from weights.gguf_source import GGUFSource

pytestmark = pytest.mark.slow

# 2 key heads shared by 4 value heads (tiled in the GGUF), heads 32 wide: a Q8_0 block, so ssm_out's columns
# reorder by whole blocks; partial rotary on a quarter of attention's 32 dims
DELTANET = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)  # fmt: skip
FAMILIES = {
    # three DeltaNet layers, then attention (full_attention_interval 4)
    "qwen35": TinyFamily("qwen35", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=False, max_position_embeddings=256, **DELTANET,
    )),
    # layer types apart from the interval (read from attention.recurrent_layers), a tied head, 8 experts (2 a
    # token, renormalized) and a shared one
    "qwen35moe": TinyFamily("qwen35moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        tie_word_embeddings=True, max_position_embeddings=256, **DELTANET,
    )),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def qwen35_gguf(request, llama_cpp_tree, tmp_path_factory, byte_vocab):  # noqa: F811
    """(the transformers model, its folder, llama.cpp's F32 GGUF of it, and its Q8_0 one)"""
    tmp = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_model(FAMILIES[request.param], len(byte_vocab["tokens"]))
    model.save_pretrained(tmp / "hf")
    tokenizer = {"model": {"vocab": {t: i for i, t in enumerate(byte_vocab["tokens"])}}, "added_tokens": []}
    (tmp / "hf" / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp / "vocab.json").write_text(json.dumps(byte_vocab))
    files = []
    for outtype in ("f32", "q8_0"):
        files.append(tmp / f"{request.param}.{outtype}.gguf")
        run = subprocess.run(
            [sys.executable, DRIVER, llama_cpp_tree, tmp / "hf", files[-1], tmp / "vocab.json", outtype],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
    return model, tmp / "hf", *files


def logits(model, linear, kernels: bool) -> tuple[torch.Tensor, list]:
    """kvserve's float32 logits of the prompt (a prefill of 16, then one token at a time), and each linear
    layer's bits (None: dense)."""
    path = CpuPath(kernels)
    ours, config = path.load(model, linear=linear)
    ids = prompt_ids(config.vocab_size)[0].tolist()
    out = path.run(ours, KVCache(config, 64, 4, torch.float32, "cpu"), ids, 0, list(range(16)))
    return out, [getattr(m, "bits", None) for m in ours.modules() if isinstance(m, Linear)]


def reference(model) -> torch.Tensor:
    with torch.no_grad():
        return model(prompt_ids(model.config.vocab_size)).logits[0].float()


@pytest.mark.timeout(300)
def test_metadata_reads_back_as_the_folders_config(qwen35_gguf):
    model, _, gguf, _ = qwen35_gguf
    config, theirs = GGUFSource(gguf).config, model.config
    names = [
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "layer_types", "linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "rms_norm_eps", "tie_word_embeddings", "vocab_size",
    ]  # fmt: skip
    if "moe" in theirs.model_type:
        names += [
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ]
        assert "intermediate_size" not in config  # the converter writes no dense feed_forward_length
    else:
        names += ["intermediate_size"]
    assert {n: config[n] for n in names} == {n: getattr(theirs, n) for n in names}
    rope = theirs.rope_parameters
    assert (config["partial_rotary_factor"], config["rope_theta"]) == (
        rope["partial_rotary_factor"],
        rope["rope_theta"],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", [True, False])
def test_llama_cpp_gguf_serves_as_transformers_runs_the_folder(qwen35_gguf, kernels):
    model, _, gguf, _ = qwen35_gguf
    source = GGUFSource(gguf)
    state = model.state_dict()
    # every tensor the original's, but those the converter computed on: A_log, as log(-(-exp(A_log))), a rounding
    # or two off; the norms stored as fl(1 + w), given back as fl(fl(1 + w) - 1) (test_gguf_arches.py's Gemma
    # bound), all but DeltaNet's gated norm, stored as it is
    for name in source.shapes:
        if name not in state:
            continue
        shifted = name.endswith("norm.weight") and "linear_attn" not in name
        tolerance = (
            2**-23 * (1 + state[name].abs()).max() if shifted else 1e-6 if name.endswith("A_log") else 0
        )
        torch.testing.assert_close(source.dense(name), state[name], rtol=0, atol=tolerance, msg=name)
    ours, _ = logits(source, PlainLinear(), kernels)
    want = reference(model)
    assert (ours - want).abs().max() < 1e-4, (ours - want).abs().max()


def with_weights(model, source: GGUFSource) -> None:
    """The transformers model's weights set to the GGUF's values (an MoE's experts stacked as transformers holds
    them: gate | up rows, per expert)."""
    state = {name: source.dense(name) for name in source.shapes}
    for i in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in state:
            continue
        experts = range(model.config.num_experts)
        gate, up, down = (
            torch.stack([state.pop(f"{prefix}.{e}.{kind}_proj.weight") for e in experts])
            for kind in ("gate", "up", "down")
        )
        state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"] = torch.cat((gate, up), 1), down
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)


@pytest.mark.timeout(300)
def test_q8_0_stays_quantized_and_gives_its_weights_logits(qwen35_gguf):
    model, _, _, gguf = qwen35_gguf
    source = GGUFSource(gguf)
    # the DeltaNet's projections quantized, ssm_out's columns (value heads in llama.cpp's order) block by block
    assert source.tensors["blk.0.ssm_out.weight"].tensor_type.name == "Q8_0"
    kinds = [
        type(source.get(f"model.layers.0.linear_attn.{p}.weight")).__name__
        for p in ("in_proj_qkv", "out_proj")
    ]
    assert kinds == ["GGMLBlocks", "GGMLBlocks"]
    original = reference(model)
    model = copy.deepcopy(model)  # the fixture's stays the folder's
    with_weights(model, source)
    want = reference(model)
    kernels = QuantizedLinear(cpu_kernels(), PlainLinear())
    ours, bits = logits(source, kernels, True)
    linear = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    # each DeltaNet layer's in_proj and out_proj kept as 8-bit integers
    assert bits.count(8) >= 2 * len(linear), bits
    # the exact weights; the kernels take float32 activations as int16 on AVX2 tiers (half a step of 1/32767 of
    # each group's largest input), the only error beside float32 sums
    assert (ours - want).abs().max() < 2e-3, (ours - want).abs().max()
    dense, _ = logits(source, PlainLinear(), True)  # dequantized at load: the same weights
    assert (dense - want).abs().max() < 1e-4, (dense - want).abs().max()
    # and Q8_0's rounding of the original's weights moves its logits (measured: a mean of 0.05 of their 0.8 spread,
    # 0.11 with the MoE's routing flips; through the DeltaNet's state the error grows along the prompt)
    error = (ours - original).abs().mean()
    assert error < 0.2 * original.std(), (error, original.std())


@pytest.mark.timeout(300)
def test_multi_token_prediction_layers_are_skipped(qwen35_gguf, llama_cpp_tree, tmp_path):  # noqa: F811
    """Qwen3.5's releases carry an MTP block (mtp_num_hidden_layers: 1), which llama.cpp's converter writes as one
    more layer (block_count counts it, nextn_predict_layers says how many); kvserve serves the model without it."""
    model, folder, _, _ = qwen35_gguf
    hf = tmp_path / "hf"
    hf.mkdir()
    for file in folder.iterdir():
        (hf / file.name).write_bytes(file.read_bytes())
    config = json.loads((hf / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (hf / "config.json").write_text(json.dumps(config))
    # the MTP block as the release names it: a full-attention layer of the model's, its input projection and norms
    state = load_file(hf / "model.safetensors")
    last = max(i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention")
    layer = {k.split(f"model.layers.{last}.")[1]: v for k, v in state.items() if f"model.layers.{last}." in k}
    hidden = model.config.hidden_size
    mtp = {f"mtp.layers.0.{k}": v.clone() for k, v in layer.items()} | {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.05,
        **{f"mtp.{norm}.weight": torch.randn(hidden) * 0.1 for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")},
    }  # fmt: skip
    save_file(state | mtp, hf / "model.safetensors", {"format": "pt"})
    run = subprocess.run(
        [sys.executable, DRIVER, llama_cpp_tree, hf, tmp_path / "mtp.gguf", folder.parent / "vocab.json", "f32"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    source = GGUFSource(tmp_path / "mtp.gguf")
    layers = model.config.num_hidden_layers
    assert f"blk.{layers}.nextn.eh_proj.weight" in source.tensors
    assert (source.config["num_hidden_layers"], source.config["mtp_num_hidden_layers"]) == (layers, 1)
    assert source.config["layer_types"] == model.config.layer_types
    ours, _ = logits(source, PlainLinear(), True)
    want = reference(model)
    assert (ours - want).abs().max() < 1e-4, (ours - want).abs().max()


@pytest.mark.timeout(300)
def test_the_engine_serves_the_file_as_it_serves_the_folder(qwen35_gguf, tmp_path):
    """Through the engine, from the file in place as `kvserve serve --model FILE.gguf` opens it: the Q8_0 file's
    two prompts batched give each its tokens alone (its weights quantized on the kernels, its DeltaNet states in
    slots), and the F32 file gives the folder's greedy tokens."""
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine
    from tests.helpers.engine_runs import alone, assert_all_blocks_free, run
    from tests.helpers.tiny_models import save_tiny_tokenizer

    model, folder, f32, q8_0 = qwen35_gguf
    config = EngineConfig(kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=16, max_num_seqs=2,
                          dtype="float32", batch_invariant=True)  # fmt: skip
    prompts = {"a": prompt_ids(model.config.vocab_size)[0, :23].tolist(), "b": list(range(5, 40))}
    engine = Engine(GGUFSource(q8_0), config)
    assert run(engine, prompts) == alone(engine, prompts)
    assert_all_blocks_free(engine)
    hf = tmp_path / "hf"  # the folder with a tokenizer the engine reads (the ids are the prompts' either way)
    hf.mkdir()
    for file in ("config.json", "generation_config.json", "model.safetensors"):
        (hf / file).write_bytes((folder / file).read_bytes())
    save_tiny_tokenizer(hf)
    from_file, from_folder = (run(Engine(m, config), prompts) for m in (GGUFSource(f32), str(hf)))
    # token ids (the texts are each tokenizer's)
    assert {r: out[0] for r, out in from_file.items()} == {r: out[0] for r, out in from_folder.items()}


@pytest.mark.timeout(120)
def test_convert_gguf_refuses_qwen35_by_name(qwen35_gguf, tmp_path):
    from weights.gguf_convert import UnsupportedGGUFError, convert_gguf

    with pytest.raises(UnsupportedGGUFError, match="-exp\\(A_log\\).*serve the file in place"):
        convert_gguf(qwen35_gguf[2], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
