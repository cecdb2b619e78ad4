"""Qwen3.5/3.6 from GGUF (`qwen35`, and `qwen35moe` and Qwen3-Next's `qwen3next` here too): llama.cpp's own
converter writes a tiny random Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet layers with fewer key heads than
value heads, so Qwen3.5's value heads are stored tiled and Qwen3-Next's projections grouped by key head; gated
attention with partial rotary; +1 baked into every norm but DeltaNet's gated one; ssm_a = -exp(A_log)), and kvserve
serves the file in place with transformers' logits on the folder it came from. Its Q8_0 file keeps every matrix
quantized on the kernels, ssm_out's columns reordered block by block, and gives the logits of that model with
those values."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.kernels import cpu_kernels
from model.linear import PlainLinear
from model.quant import QuantizedLinear
from tests.helpers.gguf_writers import TinyFamily, prompt_ids, reference_logits, served_logits, tiny_hf_model
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
    # DeltaNet and attention by turns (full_attention_interval 2), every layer sparse as llama.cpp builds
    # qwen3next (4 experts, 2 a token, renormalized, and a shared one); in_proj_qkvz and in_proj_ba grouped by key
    # head, which the converter splits as Qwen3.5's attn_qkv and attn_gate, and keeps as ssm_ba
    "qwen3next": TinyFamily("qwen3next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=256, **DELTANET,
    )),
}  # fmt: skip


def grouped(parts: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Qwen3.5's four DeltaNet projections (as a Qwen3-Next GGUF is served) grouped by key head as transformers'
    Qwen3-Next holds them: in_proj_qkvz, each key head's q, k, then its value heads' v and z; in_proj_ba, each key
    head's b, then a."""
    heads, key_rows = config.linear_num_key_heads, config.linear_num_key_heads * config.linear_key_head_dim
    q, k, v = parts["qkv"].split([key_rows, key_rows, parts["z"].shape[0]])

    def by_head(*tensors):
        return torch.cat([t.reshape(heads, -1, t.shape[-1]) for t in tensors], 1).flatten(0, 1)

    return {"in_proj_qkvz": by_head(q, k, v, parts["z"]), "in_proj_ba": by_head(parts["b"], parts["a"])}


def as_transformers_holds(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The source's tensors (every one dense) under transformers' names: a Qwen3-Next's projections grouped."""
    if config.model_type != "qwen3_next":
        return state
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.linear_attn"
        if f"{prefix}.in_proj_qkv.weight" in state:
            parts = {p: state.pop(f"{prefix}.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")}
            state |= {f"{prefix}.{name}.weight": t for name, t in grouped(parts, config).items()}
    return state


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


@pytest.mark.timeout(300)
def test_metadata_reads_back_as_the_folders_config(qwen35_gguf):
    model, _, gguf, _ = qwen35_gguf
    config, theirs = GGUFSource(gguf).config, model.config
    names = [
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "layer_types", "linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "rms_norm_eps", "tie_word_embeddings", "vocab_size",
    ]  # fmt: skip
    if getattr(theirs, "num_experts", 0):
        names += [
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ]
    if theirs.model_type == "qwen3_5_moe_text":
        assert "intermediate_size" not in config  # the converter writes no dense feed_forward_length
    else:
        names += ["intermediate_size"]
    if theirs.model_type == "qwen3_next":  # llama.cpp's build: every layer sparse, the top k renormalized
        names += ["mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"]
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
    source = GGUFSource(gguf)  # as served: Qwen3.5's value heads in the file's order
    hf_order = GGUFSource(gguf, hugging_face_order=True)
    state = model.state_dict()
    served = as_transformers_holds({name: hf_order.dense(name) for name in hf_order.shapes}, model.config)
    # every tensor the original's, but those the converter computed on: A_log, as log(-(-exp(A_log))), a rounding
    # or two off; the norms stored as fl(1 + w), given back as fl(fl(1 + w) - 1) (test_gguf_arches.py's Gemma
    # bound), all but DeltaNet's gated norm, stored as it is. Qwen3-Next's projections regrouped exactly.
    assert {name for name in served if "linear_attn" in name} <= set(state)
    for name in served:
        if name not in state:
            continue
        shifted = name.endswith("norm.weight") and "linear_attn" not in name
        tolerance = (
            2**-23 * (1 + state[name].abs()).max() if shifted else 1e-6 if name.endswith("A_log") else 0
        )
        torch.testing.assert_close(served[name], state[name], rtol=0, atol=tolerance, msg=name)
    ours, _ = served_logits(source, PlainLinear(), kernels)
    want = reference_logits(model)
    assert (ours - want).abs().max() < 1e-4, (ours - want).abs().max()


def with_weights(model, source: GGUFSource) -> None:
    """The transformers model's weights set to the GGUF's values (an MoE's experts stacked as transformers holds
    them: gate | up rows, per expert; a Qwen3-Next's DeltaNet projections grouped by key head)."""
    state = as_transformers_holds({name: source.dense(name) for name in source.shapes}, model.config)
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
    original = reference_logits(model)
    model = copy.deepcopy(model)  # the fixture's stays the folder's
    with_weights(model, GGUFSource(gguf, hugging_face_order=True))
    want = reference_logits(model)
    kernels = QuantizedLinear(cpu_kernels(), PlainLinear())
    ours, bits = served_logits(source, kernels, True)
    linear = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    # each DeltaNet layer's in_proj and out_proj kept as 8-bit integers
    assert bits.count(8) >= 2 * len(linear), bits
    # the exact weights; the kernels take float32 activations as int16 on AVX2 tiers (half a step of 1/32767 of
    # each group's largest input), the only error beside float32 sums (measured: each token's largest error ~1e-3,
    # the worst 1.6e-3 for Qwen3.5-MoE, 2.3e-3 for Qwen3-Next; dequantized, the same weights give 2e-5)
    assert (ours - want).abs().max() < 3e-3, (ours - want).abs().max()
    dense, _ = served_logits(source, PlainLinear(), True)  # dequantized at load: the same weights
    assert (dense - want).abs().max() < 1e-4, (dense - want).abs().max()
    # and Q8_0's rounding of the original's weights moves its logits (measured: a mean of 0.05 of their 0.8 spread,
    # 0.11 with the MoE's routing flips; through the DeltaNet's state the error grows along the prompt)
    error = (ours - original).abs().mean()
    assert error < 0.2 * original.std(), (error, original.std())


@pytest.mark.timeout(120)
def test_value_heads_are_served_in_the_files_order_so_k_quant_blocks_stay(qwen35_gguf):
    """llama.cpp's converter stores a Qwen3.5 file's value heads tiled where key heads are fewer (here 2 and 4);
    kvserve serves them in that order (the model reads key head h % 2 for value head h), so every DeltaNet tensor
    is read as stored and out_proj stays quantized even in a K-quant, whose 256-column blocks span two value heads
    and could not be put in Hugging Face's order (Q4_K_M's out_proj was dequantized to float32: 7x its bytes read
    at every token). The logits are transformers' either way (test_llama_cpp_gguf_serves_as_transformers_...)."""
    from gguf import GGMLQuantizationType

    _, _, _, q8_0 = qwen35_gguf
    served, hf_order = GGUFSource(q8_0), GGUFSource(q8_0, hugging_face_order=True)
    # Qwen3.5's and Qwen3.5-MoE's files; Qwen3-Next's group their heads by key head
    tiled = served.family.tiled_value_heads
    assert served.config.get("linear_value_heads_tiled", False) is tiled
    assert "linear_value_heads_tiled" not in hf_order.config
    layer = served.config["layer_types"].index("linear_attention")
    out_proj = f"model.layers.{layer}.linear_attn.out_proj.weight"
    assert all(piece.exact(GGMLQuantizationType.Q4_K) for piece in served.plan[out_proj])
    assert all(piece.exact(GGMLQuantizationType.Q4_K) for piece in hf_order.plan[out_proj]) is not tiled
    as_served, as_hugging_face = served.dense(out_proj), hf_order.dense(out_proj)
    assert as_served.shape == as_hugging_face.shape
    if tiled:  # the same columns, in another order
        assert not torch.equal(as_served, as_hugging_face)
        assert torch.equal(as_served.sort(1).values, as_hugging_face.sort(1).values)


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
    ours, _ = served_logits(source, PlainLinear(), True)
    want = reference_logits(model)
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


def test_rows_grouped_by_key_head_come_apart_as_qwen35s():
    """Qwen3-Next's ssm_ba (and an older converter's ssm_in, transformers' in_proj_qkvz as it is) read as Qwen3.5's
    projections: every row where it belongs, 3 value heads a key head (integer rows, compared exactly)."""
    from types import SimpleNamespace

    from weights.gguf_arch import key_head_groups

    shapes = dict(
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=4, linear_value_head_dim=5
    )
    rows = {"qkv": 2 * 2 * 4 + 6 * 5, "z": 6 * 5, "b": 6, "a": 6}
    parts, start = {}, 0
    for name, n in rows.items():
        parts[name] = torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 3)
        start += n
    stored = grouped(parts, SimpleNamespace(**shapes))
    tensors = {"attn_qkv": "qkv", "attn_gate": "z", "ssm_beta": "b", "ssm_alpha": "a"}
    for gguf_name, hf_name in (("ssm_in", "in_proj_qkvz"), ("ssm_ba", "in_proj_ba")):
        pieces = {}
        for target, part, rows_slice in key_head_groups(shapes, gguf_name):
            pieces.setdefault(target, {})[part] = stored[hf_name][rows_slice]
        for target, by_part in pieces.items():
            assert sorted(by_part) == list(range(len(by_part)))
            got = torch.cat([by_part[i] for i in range(len(by_part))])
            assert torch.equal(got, parts[tensors[target]]), target


@pytest.mark.timeout(60)
def test_bench_peers_gives_kvserve_room_for_llama_cpps_slots_of_state(qwen35_gguf):
    """scripts/bench_peers.py sizes kvserve's cache for what llama.cpp holds with `-c N -np 32`: N tokens of the
    attention layers' K/V, and 32 running DeltaNet states, which llama.cpp keeps one per slot beside its -c. With
    that budget kvserve runs the 32 sequences at once and still holds N tokens of K/V (sized on -c alone, a
    Qwen3.5 file ran 15 of 32)."""
    import importlib

    import torch

    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from server.engine.config import EngineConfig
    from server.engine.setup import cache_layout

    scripts = str(Path(__file__).parents[2] / "scripts")
    sys.path.insert(0, scripts)
    try:
        bench_peers = importlib.import_module("bench_peers")
    finally:
        sys.path.remove(scripts)
    q8_0 = qwen35_gguf[3]
    budget = bench_peers.kvserve_budget(q8_0, 4096, 32)
    source = GGUFSource(q8_0)
    config = ModelConfig.from_dict(source.config, source.generation_config)
    engine = EngineConfig(kv_cache_memory=budget, block_size=16, max_num_seqs=64)
    layout = cache_layout(config, engine, torch.bfloat16, budget)
    assert layout.num_state_slots >= 32
    assert layout.num_blocks * 16 >= 4096
    per_token = KVCache.bytes_per_block(config, 1, torch.bfloat16)
    assert per_token * 4096 < budget - 32 * KVCache.bytes_per_state_slot(config)
