"""The terminal entry points, run as a user would."""

import subprocess
import sys

import pytest
import torch


def kvserve(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_is_deterministic_at_temperature_0(default_model_dir):
    # float32 as the reference computes it, on every tier (AVX2's default int8 activations tip the first token)
    args = ["generate", "--model", str(default_model_dir), "--prompt", "What is the capital of France?",
            "--max-tokens", "12", "--temperature", "0", "--dtype", "float32", "--gemm-activations", "wide",
            "--kv-cache-memory", "64MiB"]  # fmt: skip
    first, second = kvserve(*args), kvserve(*args)
    assert first.returncode == 0, first.stderr
    assert "Paris" in first.stdout
    assert first.stdout == second.stdout


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(120)
def test_generate_streams_with_a_system_prompt_and_sampling(tiny_llama_dir):
    out = kvserve("generate", "--model", str(tiny_llama_dir), "--prompt", "hello", "--system", "Be brief.",
                  "--max-tokens", "5", "--temperature", "0.8", "--top-k", "20", "--seed", "3")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(tiny_llama_dir):
    out = kvserve("generate", "--model", str(tiny_llama_dir), "--prompt", "x", "--device", "cuda")
    assert out.returncode == 1
    assert "no CUDA GPU" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(60)
def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"], "vocab_size": 10}')
    out = kvserve("generate", "--model", str(tmp_path), "--prompt", "x")
    assert out.returncode == 1
    assert "FalconForCausalLM" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_model_measures_the_dtype_asked_for(tiny_llama_dir):
    import json

    common = [
        "bench-model",
        "--model",
        str(tiny_llama_dir),
        "--runs",
        "1",
        "--prompt-len",
        "8",
        "--output-len",
        "4",
    ]
    one = kvserve(*common, "--dtype", "float32")
    assert one.returncode == 0, one.stderr
    assert [json.loads(line)["dtype"] for line in one.stdout.splitlines()] == ["float32"]
    both = kvserve(*common)
    assert [json.loads(line)["dtype"] for line in both.stdout.splitlines()] == ["float32", "bfloat16"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "command,a,b,summary",
    [
        ("bench-invariance", "invariant", "not_invariant", lambda a, b: round(100 * (1 - a / b), 1)),
        ("bench-kernels", "cpp", "torch", lambda a, b: round(a / b, 2)),
    ],
)
@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
def test_interleaved_benches_report_both_engines_per_batch_size(tiny_llama_dir, command, a, b, summary):
    import json

    out = kvserve(command, "--model", str(tiny_llama_dir), "--batch-sizes", "1", "3",
                  "--steps", "5", "--input-len", "20", "--kv-cache-memory", "8MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        x, y = r[f"{a}_tokens_per_s"], r[f"{b}_tokens_per_s"]
        assert x > 0 and y > 0
        assert summary(x, y) in (r.get("cost_percent"), r.get("speedup"))


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(120)
def test_bench_profile_splits_a_step_into_its_parts(tiny_llama_dir):
    import json

    out = kvserve("bench-profile", "--model", str(tiny_llama_dir), "--batch-sizes", "1", "3", "--steps", "4",
                  "--reps", "2", "--context-len", "20", "--kv-cache-memory", "8MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        parts = ("block_gemms_ms", "lm_head_ms", "attention_ms", "norms_and_swiglu_ms")
        assert r["step_ms"] > 0 and all(r[p] > 0 for p in parts)
        # six figures, each rounded to the microsecond on its own: up to 0.003 ms apart
        assert r["rest_ms"] == pytest.approx(r["step_ms"] - sum(r[p] for p in parts), abs=0.005)
        # the tiny llama's four block GEMMs, named with their shapes (out x in)
        assert list(r["gemm_us_per_call"]) == ["qkv 128x64", "o 64x64", "gate_up 256x64", "down 64x128"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_profile_times_a_moe_models_sparse_ffns_whole(tiny_model_factory):
    """Qwen3-MoE's tiny model: layer 0 sparse, layer 1 dense (mlp_only_layers). The sparse FFN (router, experts,
    sum) is its own part; the dense layer's FFN GEMMs are timed as a dense model's."""
    import json

    from tests.helpers.tiny_models import tiny_family

    out = kvserve("bench-profile", "--model", str(tiny_family(tiny_model_factory, "qwen3moe")), "--batch-sizes",
                  "2", "--steps", "4", "--reps", "2", "--context-len", "20", "--kv-cache-memory", "8MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    parts = ("block_gemms_ms", "lm_head_ms", "attention_ms", "norms_and_swiglu_ms", "moe_ffn_ms")
    assert all(row[p] > 0 for p in parts)
    assert row["rest_ms"] == pytest.approx(row["step_ms"] - sum(row[p] for p in parts), abs=0.005)
    assert list(row["gemm_us_per_call"]) == ["qkv 256x64", "o 64x128", "gate_up 256x64", "down 64x128"]
    # a step reads its weights and does more: never faster than one plain read of them (the ratio is computed
    # before rounding: a tiny model's read is a few microseconds)
    assert row["active_weight_mib"] > 0 and row["weights_read_ms"] > 0 and row["step_over_read"] > 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_profile_times_a_hybrids_deltanet_between_its_projections(tiny_model_factory):
    """Qwen3.5's tiny model: three Gated DeltaNet layers (their in_proj and out GEMMs, the recurrence between them
    as its own part) and a gated attention layer with partial rotary (qkv's rows include the gate)."""
    import json

    from tests.helpers.tiny_models import tiny_family

    out = kvserve("bench-profile", "--model", str(tiny_family(tiny_model_factory, "qwen3_5")), "--batch-sizes",
                  "1", "2", "--steps", "4", "--reps", "2", "--context-len", "20", "--kv-cache-memory", "8MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    for row in (json.loads(line) for line in out.stdout.splitlines()):
        parts = ("block_gemms_ms", "lm_head_ms", "attention_ms", "norms_and_swiglu_ms", "deltanet_ms")
        assert all(row[p] > 0 for p in parts)
        assert row["rest_ms"] == pytest.approx(row["step_ms"] - sum(row[p] for p in parts), abs=0.005)
        names = [name.split()[0] for name in row["gemm_us_per_call"]]
        assert names == ["in_proj", "out", "gate_up", "down", "qkv", "o"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_profile_times_gemma4s_own_gemms(tiny_model_factory):
    """Gemma 4's tiny model: its full layers' and its K/V-reading layers' GEMMs by their own shapes, its per-layer
    inputs' gate and projection GEMMs among the block's; a token reads a row of the per-layer table, not all of it."""
    import json

    from tests.helpers.tiny_models import tiny_family

    out = kvserve("bench-profile", "--model", str(tiny_family(tiny_model_factory, "gemma4")), "--batch-sizes", "2",
                  "--steps", "4", "--reps", "2", "--context-len", "20", "--kv-cache-memory", "8MiB",
                  "--quantization", "int8")  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    names = list(row["gemm_us_per_call"])
    assert {name.split()[0] for name in names} == {
        "qkv",
        "o",
        "gate_up",
        "down",
        "per_layer_gate",
        "per_layer_proj",
    }
    # sliding and full layers, with K/V of their own and reading an earlier one's (queries only)
    assert len([name for name in names if name.startswith("qkv ")]) == 4
    parts = ("block_gemms_ms", "lm_head_ms", "attention_ms", "norms_and_swiglu_ms")
    assert row["rest_ms"] == pytest.approx(row["step_ms"] - sum(row[p] for p in parts), abs=0.005)


def test_a_gemma4_token_reads_a_row_of_its_per_layer_table(tiny_model_factory):
    import torch

    from model.loader import load_model
    from server.bench.offline import active_weight_bytes, weight_bytes
    from tests.helpers.tiny_models import tiny_family

    model, config = load_model(tiny_family(tiny_model_factory, "gemma4"), torch.float32, "cpu")
    table = weight_bytes(model.per_layer_embed)
    width = config.num_layers * config.per_layer_input_size
    assert config.tie_word_embeddings and table == 4 * config.per_layer_vocab_size * width
    assert active_weight_bytes(model) == weight_bytes(model) - table


def test_a_tokens_active_weights_are_its_k_experts_of_each_sparse_layer(tiny_model_factory):
    """Qwen3-MoE's tiny model, 8-bit: a token reads 2 of layer 0's 8 experts (layer 1 is dense), its embedding
    row only (untied), everything else whole."""
    import torch

    from model.kernels import cpu_kernels
    from model.linear import PlainLinear
    from model.loader import load_model
    from model.quant import QuantizedLinear
    from model.transformer import Ops
    from server.bench.offline import active_weight_bytes, weight_bytes
    from tests.helpers.tiny_models import FAMILY_OVERRIDES

    path = tiny_model_factory("qwen3moe", **FAMILY_OVERRIDES["qwen3moe"] | {"tie_word_embeddings": False})
    ops = Ops.with_kernels(QuantizedLinear(cpu_kernels(), PlainLinear(), 8), cpu_kernels())
    model, config = load_model(path, torch.float32, "cpu", ops)
    expert = weight_bytes(model.layers[0].mlp.experts[0])
    assert (
        expert > 0 and (config.moe.num_experts, config.moe.top_k) == (8, 2) and not config.tie_word_embeddings
    )
    # an 8-bit expert's bytes are its packed buffers, each once (its `packed` is also an attribute)
    assert expert == sum(b.numel() * b.element_size() for b in model.layers[0].mlp.experts[0].buffers())
    unread = 6 * expert + weight_bytes(model.embed)
    assert active_weight_bytes(model) == weight_bytes(model) - unread


def test_bench_gemms_times_each_gemm_against_onednn_on_the_same_weights(tiny_llama_dir):
    import json

    out = kvserve("bench-gemms", "--model", str(tiny_llama_dir), "--quantization", "int4", "--rows", "1", "17",
                  "--reps", "2", "--kv-cache-memory", "8MiB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["rows"] for r in rows] == [1, 17]
    from model.linear import OneDnnLinear

    # oneDNN's bfloat16 GEMM where the CPU multiplies bfloat16 (an AVX2-only host has none to compare with)
    onednn = OneDnnLinear.available(torch.bfloat16, torch.device("cpu"))
    for r in rows:
        calls = r["us_per_call"]
        assert list(calls) == ["qkv 128x64", "o 64x64", "gate_up 256x64", "down 64x128", "lm_head 300x64"]
        # a prompt of `rows` tokens attending to itself, every layer, beside the GEMMs; on AMX's tiles too where
        # the run computes a prompt's rows apart
        assert r["kvserve_attention_ms"] > 0
        assert ("kvserve_prompt_attention_ms" in r) == ("kvserve_prompt_block_gemms_ms" in r)
        assert all(t["kvserve"] > 0 for t in calls.values())
        # a step's block GEMMs: each shape once per layer (the tiny llama has 2)
        block = sum(t["kvserve"] for name, t in calls.items() if not name.startswith("lm_head")) * 2 / 1e3
        assert r["kvserve_block_gemms_ms"] == pytest.approx(block, rel=0.01, abs=0.002)
        if not onednn:
            assert all(list(t) == ["kvserve"] for t in calls.values()) and "block_gemms_speedup" not in r
            continue
        assert all(t["onednn_bf16"] > 0 for t in calls.values())
        assert r["block_gemms_speedup"] == pytest.approx(  # rounded to hundredths: 0.4 for 0.3955
            r["onednn_bf16_block_gemms_ms"] / r["kvserve_block_gemms_ms"], abs=0.005
        )


def test_speculative_config_is_auto_unless_turned_off_or_given():
    from server.commands import speculative_config
    from server.engine.config import SpeculativeConfig

    assert speculative_config(None) == speculative_config("auto") == "auto"
    assert speculative_config("off") is None
    assert speculative_config('{"num_speculative_tokens": 2}') == SpeculativeConfig(num_speculative_tokens=2)
    for bad in ('{"method": "eagle"}', "[1]", "on"):
        with pytest.raises(SystemExit, match="--speculative-config"):
            speculative_config(bad)


def test_reasoning_parser_takes_vllms_names_and_refuses_others(capsys, monkeypatch):
    from server.cli import parser
    from server.commands import server_config

    monkeypatch.delenv("KVSERVE_REASONING_PARSER", raising=False)
    assert server_config(parser().parse_args(["serve"]), None).reasoning_parser == "auto"
    for name in ("think", "harmony", "none", "deepseek_r1", "qwen3", "gpt_oss"):
        args = parser().parse_args(["serve", "--reasoning-parser", name])
        assert server_config(args, None).reasoning_parser == name
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--reasoning-parser", "r1"])
    assert "invalid choice: 'r1'" in capsys.readouterr().err


def test_a_vllm_serve_command_line_runs_as_it_is(monkeypatch, caplog):
    """`vllm serve MODEL` and the flags its users pass: read into kvserve's own, said where they change nothing,
    refused by name where they ask for what kvserve does not do."""
    from server.cli import parser
    from server.commands import server_config, vllm_flags

    caplog.set_level("INFO")
    for name in (
        "KVSERVE_SERVED_MODEL_NAME",
        "KVSERVE_MODEL",
        "KVSERVE_WEIGHTS_DIR",
        "KVSERVE_TOOL_CALL_PARSER",
    ):
        monkeypatch.delenv(name, raising=False)

    def read(*argv):
        args = parser().parse_args(["serve", *argv])
        vllm_flags(args)
        return args

    args = read("/models/qwen3", "--served-model-name", "qwen", "gpt-4o", "qwen", "--download-dir", "/w", "-tp", "1",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-remote-code", "--seed", "7",
                "--disable-log-requests")  # fmt: skip
    assert (args.model, args.weights_dir, args.seed) == ("/models/qwen3", "/w", 7)
    config = server_config(args, args.model)
    assert (config.served_model_name, config.model_aliases, config.log_requests) == (
        "qwen",
        ["gpt-4o"],
        False,
    )
    assert "--enable-auto-tool-choice, --tool-call-parser, --trust-remote-code: taken" in caplog.text
    monkeypatch.setenv("KVSERVE_SERVED_MODEL_NAME", "one two")
    assert server_config(read(), None).model_aliases == ["two"]
    assert read("--model", "/m", "/m").model == "/m"  # the same model twice is the one model
    for argv, why in [
        (("/a", "--model", "/b"), "the model is given twice"),
        (("-tp", "2"), "--tensor-parallel-size 2: kvserve runs on one GPU or the CPU"),
        (("--pipeline-parallel-size", "4"), "--pipeline-parallel-size 4"),
        (("--tool-call-parser", "llama3_json"), "--tool-call-parser llama3_json: kvserve reads tool calls"),
        (("--download-dir", "/a", "--weights-dir", "/b"), "not both"),
    ]:
        with pytest.raises(ValueError, match=why):
            read(*argv)


def test_unseeded_requests_draw_as_the_server_seed_says(tiny_llama_dir):
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams
    from tests.helpers.engine_runs import run

    def texts(seed):
        engine = Engine(str(tiny_llama_dir), EngineConfig(kv_cache_memory=4 << 20, block_size=4, seed=seed))
        params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
        return [text for _, text, _ in run(engine, {"a": [5, 6, 7], "b": [5, 6, 7]}, params).values()]

    first = texts(7)
    assert first == texts(7) and first[0] != first[1]  # the same server seed draws the same; requests differ
    assert first != texts(8)
