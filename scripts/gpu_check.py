"""The GPU check (issue 48 item 5): what kvserve's GPU path does on the machine it runs on, in one command that fits
the ~8 minutes a lent H200 gives. Each section prints one JSON line (also appended to OUT/gpu_check.jsonl); a section
that fails records its error and the others still run, so one bad minute on the GPU still measures the rest.

    bash scripts/gpu_check.sh run         # on the GPU machine (the carried wheels installed first)
    python scripts/gpu_check.py --small   # anywhere, tiny shapes on the CPU: what the test suite runs

Sections, in order:
- environment: torch, CUDA, the device, triton, the commit.
- copy_bandwidth: a device-to-device copy, bytes read + written per second (the H200's ~4.3 TB/s): the
  bandwidth the decode floor below is held to.
- cuda_tests: the `cuda`-marked tests (pytest -m cuda).
- parity: every family's tiny random model in float32, kvserve's greedy tokens against transformers' generate
  on the same device; and bfloat16 against float32 teacher-forced (top-1 agreement, mean KL).
- shape:<name>: a random-weight model of the default model's shape and of a 1B Llama's, built on the device in
  bfloat16: the batch-1 decode step against its floor (weight and KV bytes read / copy bandwidth), output tok/s
  at batches 1, 32, 128, 256 against transformers' batched generate on the same prompts, the TTFT of a 2,000-token
  prompt against its compute floor, the share of decode steps replayed from CUDA graphs.
- shape:<largest>-int4: the largest shape again, its weights quantized at load to 4 bits (Q4_1's form) and
  multiplied by the quantized GEMM (on a GPU kvserve's Triton kernel, model/linear_triton.py): the same figures
  against its own, smaller floor, without a second transformers baseline.
- http: the 1B shape served over HTTP, `kvserve bench` at concurrency 1 and 64.
- shape:qwen3_5-q35: a Qwen3.5 near 1.5B (18 Gated DeltaNet and 6 gated attention layers): its DeltaNet steps on
  the device (a step of decodes together, graphed; prompts in blocks of 64), the floor counting each sequence's
  DeltaNet state read and written a step; transformers' generate at batches 1 and 32 only.
- shape:qwen3moe-30b-a3b-L6: Qwen3-30B-A3B's layers (128 experts, 8 a token; 6 of its 48 layers), the same
  figures (the floor reads a token's 8 experts of each layer, not all 128), transformers' generate at batches 1 and
  32 only (its experts run eagerly). Last: its 9 GB of weights take the longest to build. Then again with its
  weights quantized at load to 4 bits, the experts grouped on quantized tiles (model/moe_triton.py).

Predicted on the H200 before any run (../shared/GPU.md, a reading of the code at fc4b6d2): decode launch-bound,
4-8 ms a step, ~150-250 tok/s at batch 1, against a floor of ~0.06 ms (default shape) and ~0.58 ms (1B).
Predicted again at dae6eaa (Triton attention reading the cache in place, decode steps replayed from CUDA graphs,
no host wait inside a step): ~12 kernels a layer, each a few microseconds even when replayed, so the default
shape's step ~1-1.5 ms (30 layers; still 15-25x its floor: tiny GEMVs cannot fill the GPU) and the 1B shape's
~0.9-1.2 ms (16 layers; its GEMVs near the bandwidth: 1.5-2x the floor, the 1.6x target at its edge); batch 256
far past transformers' generate (whose cache is copied and whose steps are eager); a replay share near 1 for the
pure-decode stretches of the batch runs.
Predicted at 36da080 for the Qwen3-30B-A3B shape: a token reads ~1.3 GB (attention, 8 of 128 experts a layer, the
LM head), a floor of ~0.3 ms; ~35 kernels a layer (routing, the device-side sort, two grouped GEMMs), replayed from
graphs, ~0.6-0.8 ms a step (2-2.5x the floor). Before it (the loop over experts: a host read and ~50 launches a
layer, no graphs) ~3-5 ms.
Predicted at b9d7f58 for the Qwen3.5 shape: ~3 GB of weights and ~40 MB of state a token, a floor of ~0.75 ms; ~60
kernels a DeltaNet layer in a graphed decode step, ~1-1.5 ms a step at batch 1 (1.5-2x the floor); its 2,000-token
prompt ~32 blocks a DeltaNet layer, ~0.1-0.2 s, where a token at a time took ~10 s.
Predicted at 6d48965 for its int4 run (the experts quantized, grouped on dequantized tiles): ~0.55 GB a token (5 bits
a weight, the LM head 8.5), a floor of ~0.13 ms; the grouped GEMMs' tiles of 16 rows dequantize each weight tile for
one token at batch 1, so ~0.5-0.7 ms a step (4-5x its floor), its batches above the bfloat16 run's from batch 32.

Measured on an H200 on 2026-12-04 (the first runs; copy 4.1 TB/s), at 2a117fc, then at e78db84 (fused norms, SwiGLU,
RoPE with the K/V writes):
- 1B shape: a batch-1 step 2.08, then 2.05 ms (3.4x its 0.60 ms floor), of which the graph's replay alone is
  0.91 ms (1.5x: its GEMMs read at ~3.7 TB/s) and the host's step ~1.1 ms: the step waits on the host, not the GPU.
  Batch 256 at 20,200, then 28,300 tok/s, 4.9x, then 6.9x transformers' generate; TTFT of 2,000 tokens 15 ms (2.4x).
- Default shape: 2.22, then 1.66 ms a step (graph 0.82 ms: tiny GEMVs, 281 kernels eager); batch 256 6.9x generate.
- The predictions' error: the GPU's own time was near them (0.9 ms for the 1B, 0.8 for the default), but the step
  they did not count, the host's scheduling, sampling and output handling between replays, is half of it or more.
- Qwen3-30B-A3B L6: 1.68 ms a step (5.1x its 0.32 ms floor; 0.6-0.8 ms was predicted, the host's share again
  uncounted), 39x generate at batch 1; its int4 run 1.86 ms. Qwen3.5: 6.0 ms a step, TTFT 0.49 s (65x its
  floor): its DeltaNet prompts were ~35 kernels a block then, its decodes' recurrence ~35 a layer.
- Parity: gemma2's and gpt_oss's float32 greedy tokens were not transformers' (logit gaps 0.06 and 0.43), and 5
  cuda tests failed: that machine's transformers (5.17) runs Gemma 2 through SDPA, without its soft-cap, and fixes
  GPT-OSS's SwiGLU limit at 7.0 whatever the config says (the tiny model's is 1.0). With 5.17 on a CPU the same
  tests fail the same way (a 1.04 logit error); the reference is now transformers' eager model with the config's
  limit (tests/helpers/tiny_models.py's reference_model). Every other family matched.
Predicted for async scheduling (engine.py: step N + 1 launched before step N is read back), before any run of it: a
step takes the longer of the GPU's part (the 1B's graph 0.91 ms and the sampler's few kernels) and the host's
(~1 ms at batch 1, the same work as before, now beside the GPU's instead of after it), so the 1B's batch-1 step
~1.0-1.2 ms (1.7-2x its floor; decode_step_ms_in_turn, the same steps read back one by one, stays ~2 ms); at batch
256 the host's ~4-5 ms a step overlaps a GPU step of about as long: ~40,000 tok/s, ~10x generate."""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

H200_BF16_FLOPS = 790e12  # measured there (../shared/GPU.md): the compute floor of a prefill


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, built with random weights: a Llama block, with experts a Qwen3-MoE one, or with linear
    heads a Qwen3.5 one (Gated DeltaNet on three layers of four, gated attention on every fourth)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = True
    head_dim: int | None = None  # None: hidden / heads
    experts: int = 0  # a sparse FFN of this many experts, each of expert_ffn, top_k a token
    top_k: int = 0
    expert_ffn: int = 0
    # Gated DeltaNet's key and value heads, each linear_head_dim wide (a 4-tap convolution)
    linear_heads: int = 0
    linear_head_dim: int = 0

    @property
    def attention_layers(self) -> int:
        return self.layers // 4 if self.linear_heads else self.layers

    @property
    def kv_bytes_per_token(self) -> int:  # bfloat16 K and V of every attention layer
        return 2 * self.attention_layers * self.kv_heads * (self.head_dim or self.hidden // self.heads) * 2

    @property
    def state_bytes_per_step(self) -> int:
        """A sequence's DeltaNet state read and written by a decode step (float32: each head's S0 and chunk of 8
        rows, model/deltanet.py), 0 without DeltaNet layers."""
        d = self.linear_head_dim
        per_layer = self.linear_heads * (d * d + 8 * (2 * d + 1)) * 4
        return 2 * (self.layers - self.attention_layers) * per_layer


SHAPES = {
    "default": Shape(576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M-Instruct, the embedded default model
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 128256),  # Llama-3.2-1B
}
SMALL_SHAPES = {"tiny": Shape(64, 2, 4, 2, 128, 300)}
MOE_SHAPES = {  # Qwen3-30B-A3B's layers, 6 of its 48
    "qwen3moe-30b-a3b-L6": Shape(2048, 6, 32, 4, 6144, 151936, False, 128, 128, 8, 768),
}
SMALL_MOE_SHAPES = {"tiny-moe": Shape(64, 2, 4, 2, 128, 300, experts=8, top_k=2, expert_ffn=32)}
HYBRID_SHAPES = {  # Qwen3.5's near 1.5B (scripts/make_hybrid_gguf.py's q35): 18 DeltaNet and 6 attention layers
    "qwen3_5-q35": Shape(2048, 24, 8, 2, 6144, 49152, True, 256, linear_heads=16, linear_head_dim=128),
}
SMALL_HYBRID_SHAPES = {
    "tiny-hybrid": Shape(64, 4, 4, 2, 128, 300, head_dim=16, linear_heads=2, linear_head_dim=16)
}


@dataclass(frozen=True)
class Plan:
    """How much each section does: the full check on a GPU, or a small one (CPU, the test suite)."""

    copy_bytes: int
    shapes: dict
    batches: tuple
    input_len: int
    output_len: int
    ttft_prompt_len: int
    parity_families: tuple | None  # None: every family
    parity_tokens: int
    http_concurrency: tuple
    http_requests: int  # at least; twice the concurrency where that is more
    kv_cache_memory: int  # the shapes' KV cache
    # hybrid and sparse: measured last, transformers' generate only at batches up to late_baseline_batch
    late_shapes: dict
    late_baseline_batch: int


FULL = Plan(1 << 30, SHAPES, (1, 32, 128, 256), 128, 128, 2000, None, 24, (1, 64), 16, 8 << 30,
            HYBRID_SHAPES | MOE_SHAPES, 32)  # fmt: skip
SMALL = Plan(16 << 20, SMALL_SHAPES, (1, 4), 16, 8, 64, ("llama", "qwen3moe"), 8, (1, 4), 8, 256 << 20,
             SMALL_HYBRID_SHAPES | SMALL_MOE_SHAPES, 1)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes and batches (CPU, the test suite)")
    parser.add_argument("--device", default="auto", help="auto (cuda where there is one) | cuda | cpu")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where gpu_check.jsonl goes ($OUT)")
    parser.add_argument("--sections", default="all", help="comma-separated section names (prefixes), or all")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    plan = SMALL if args.small else FULL
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-models-"))
    report = Report(out / "gpu_check.jsonl")
    sections = [
        ("environment", lambda: environment(device)),
        ("copy_bandwidth", lambda: copy_bandwidth(device, plan.copy_bytes)),
        ("cuda_tests", lambda: cuda_tests(device)),
        ("parity", lambda: parity(device, plan, work)),
        *(
            (f"shape:{name}", lambda s=shape, n=name: shape_run(device, plan, work, n, s, report))
            for name, shape in plan.shapes.items()
        ),  # fmt: skip
        *(  # the largest shape's weights quantized at load to 4 bits, on the quantized GEMM (Triton on a GPU)
            (
                f"shape:{name}-int4",
                lambda s=shape, n=name: shape_run(device, plan, work, n, s, report, "int4"),
            )
            for name, shape in list(plan.shapes.items())[-1:]
        ),  # fmt: skip
        ("http", lambda: http(device, plan, work)),
        *(
            (
                f"shape:{name}",
                lambda s=shape, n=name: shape_run(
                    device, plan, work, n, s, report, baseline=plan.late_baseline_batch
                ),
            )
            for name, shape in plan.late_shapes.items()
        ),  # fmt: skip
        *(  # and its experts quantized too, grouped on the quantized tiles (as a GGUF's Q4_K_M experts run)
            (
                f"shape:{name}-int4",
                lambda s=shape, n=name: shape_run(device, plan, work, n, s, report, "int4"),
            )
            for name, shape in plan.late_shapes.items()
            if shape.experts
        ),  # fmt: skip
    ]
    wanted = None if args.sections == "all" else args.sections.split(",")
    try:
        for name, run in sections:
            if wanted is None or any(name.startswith(w) for w in wanted):
                report.section(name, run)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the models it built (2.5 GB for the 1B shape)
    report.summary()
    return 0 if all(r.get("ok") for r in report.results) else 1


class Report:
    """The sections' results, one JSON line each, printed and written as they come."""

    def __init__(self, path: Path):
        self.path, self.results = path, []
        path.write_text("")

    def section(self, name: str, run) -> None:
        start = time.monotonic()
        try:
            result = {"section": name, "ok": True, **run()}
        except Exception as e:  # noqa: BLE001 (a failed section is reported, and the next one runs)
            result = {"section": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        result["seconds"] = round(time.monotonic() - start, 1)
        self.results.append(result)
        line = json.dumps(result)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")

    def get(self, name: str) -> dict:
        return next((r for r in self.results if r["section"] == name), {})

    def summary(self) -> None:
        print("\nsection            ok     seconds")
        for r in self.results:
            print(f"{r['section']:<18} {'yes' if r['ok'] else 'NO':<6} {r['seconds']}")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None  # fmt: skip
    except OSError:
        return None


def environment(device: str) -> dict:
    result = {
        "device": device,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "commit": git_commit(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        result.update(name=props.name, capability=f"{props.major}.{props.minor}",
                      memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                      cudnn=torch.backends.cudnn.version())  # fmt: skip
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    import transformers

    result["transformers"] = transformers.__version__
    return result


def copy_bandwidth(device: str, num_bytes: int, reps: int = 20) -> dict:
    """Median bytes read + written per second of a device-to-device copy of num_bytes."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[2:])
    return {"bytes": num_bytes, "gb_per_s": round(2 * num_bytes / seconds / 1e9, 1)}


def cuda_tests(device: str) -> dict:
    """The tests marked `cuda`, in the files that have any: on the GPU they run, elsewhere they skip."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.cuda" in p.read_text(encoding="utf-8"))  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "--tb=short", "-m", "cuda",
         "-p", "no:cacheprovider",
         f"--basetemp={tempfile.mkdtemp(prefix='gpu_check-pytest-')}", *files],  # apart from a calling pytest's
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", run.stdout)
    }
    if run.returncode not in (0, 5) or counts.get("failed") or counts.get("error") or counts.get("errors"):
        # named first: the output's tail below may not reach them
        failed = re.findall(r"^FAILED (\S+)", run.stdout, re.M)
        raise RuntimeError(
            f"pytest -m cuda: {counts}, failed: {failed}\n{run.stdout[-3000:]}{run.stderr[-1000:]}"
        )
    if device == "cuda" and counts.get("skipped"):
        raise RuntimeError(f"cuda tests skipped on a GPU: {counts}\n{run.stdout[-2000:]}")
    return {"files": files, **counts}


def engine_for(
    path, device: str, dtype: str, max_num_seqs: int = 8, kv_cache_memory: int = 64 << 20, **config
):
    """An engine with a KV cache of a set size: the check builds many in one process, and on a GPU the default
    (a share of the free memory) would give each later one what the earlier ones left."""
    from server.engine.config import EngineConfig
    from server.engine.engine import Engine

    cfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_memory=kv_cache_memory,
                       speculative=None, **config)  # fmt: skip
    return Engine(str(path), cfg)


def release(device: str) -> None:
    """Memory of engines and models dropped by the caller given back before the next is built."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from server.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"p{i}"] for i in range(len(prompts))]


# float32 logits two correct implementations may order differently (their sums in another order): a greedy
# choice this close to the best is a tie, after which two runs may rightly diverge
TIE = 1e-4


def parity(device: str, plan: Plan, work: Path) -> dict:
    """Every family's tiny model in float32: each token kvserve chooses greedily (several prompts batched) is
    transformers' choice on the same text, or within TIE of it (after such a tie the two may rightly diverge);
    how many answers are identical to transformers' own generate. And kvserve in bfloat16 against float32,
    teacher-forced on a prompt and float32's answer (transformers' model as tests/helpers/tiny_models.py's
    reference_model loads it)."""
    from server.bench.offline import random_prompts
    from tests.helpers.tiny_models import ARCHES, FAMILY_OVERRIDES, build_tiny_model, reference_model

    families = plan.parity_families or tuple(ARCHES)
    gaps, identical, agreement = {}, 0, {}
    for arch in families:
        path = build_tiny_model(work / f"tiny-{arch}", arch, **FAMILY_OVERRIDES.get(arch, {}))
        reference = reference_model(path).to(device)
        prompts = random_prompts(4, 20, reference.config.vocab_size, seed=7)
        float32 = engine_for(path, device, "float32", kv_cache_dtype="float32")
        answers = greedy_tokens(float32, prompts, plan.parity_tokens)
        gap = 0.0
        with torch.no_grad():
            for prompt, answer in zip(prompts, answers, strict=True):
                ids = torch.tensor([prompt + answer], device=device)
                logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
                chosen = logits.gather(1, torch.tensor(answer, device=device)[:, None])[:, 0]
                gap = max(gap, (logits.max(-1).values - chosen).max().item())
                ids = torch.tensor([prompt], device=device)
                want = reference.generate(ids, max_new_tokens=plan.parity_tokens, do_sample=False,
                                          attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
                identical += want[0, len(prompt) :].tolist() == answer
        gaps[arch] = round(gap, 6)
        agreement[arch] = teacher_forced(
            float32, engine_for(path, device, "bfloat16"), prompts[0] + answers[0]
        )
        del reference, float32
        release(device)
    wrong = {arch: gap for arch, gap in gaps.items() if gap > TIE}
    if wrong:
        raise RuntimeError(f"float32 greedy tokens that are not transformers' choice (logit gap): {wrong}")
    return {"families": len(families), "answers": 4 * len(families), "identical_to_generate": identical,
            "max_greedy_gap": max(gaps.values()), "bf16_min_top1": min(a["top1"] for a in agreement.values()),
            "bf16_max_mean_kl": max(a["mean_kl"] for a in agreement.values()), "bf16": agreement}  # fmt: skip


def teacher_forced(reference, test, ids: list[int]) -> dict:
    """The test engine's logits at every position of ids against the reference's: top-1 agreement, mean
    KL(reference || test)."""
    p = reference.score(ids).double().log_softmax(-1)
    q = test.score(ids).double().log_softmax(-1)
    return {"top1": round((p.argmax(-1) == q.argmax(-1)).double().mean().item(), 4),
            "mean_kl": round((p.exp() * (p - q)).sum(-1).mean().item(), 6)}  # fmt: skip


def build_shape(shape: Shape, path: Path, device: str) -> Path:
    """A random-weight Llama (with experts, Qwen3-MoE; with linear heads, Qwen3.5) of the shape, bfloat16, built on
    the device (fast there) and saved with a word per token (word_tokenizer)."""
    import transformers

    common = dict(
        hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, intermediate_size=shape.ffn, vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    if shape.head_dim is not None:
        common["head_dim"] = shape.head_dim
    if shape.linear_heads:  # Qwen3.5's text model: DeltaNet on three layers of four
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape.layers)]
        config = transformers.AutoConfig.for_model(
            "qwen3_5_text", linear_num_key_heads=shape.linear_heads, linear_num_value_heads=shape.linear_heads,
            linear_key_head_dim=shape.linear_head_dim, linear_value_head_dim=shape.linear_head_dim,
            linear_conv_kernel_dim=4, layer_types=kinds, **common,
        )  # fmt: skip
        model_class = transformers.AutoModelForCausalLM.from_config
    elif shape.experts:
        config = transformers.Qwen3MoeConfig(num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                                             moe_intermediate_size=shape.expert_ffn, norm_topk_prob=True, **common)  # fmt: skip
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config, model_class = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path)
    word_tokenizer(path, shape.vocab)
    return path


def word_tokenizer(path: Path, vocab: int) -> None:
    """A tokenizer of one word per id for every id of the shape's vocabulary ("w3", "w4", ...; a word it does not
    know is id 0): a random model's tokens then decode to text, which `kvserve bench` times (a byte-level tokenizer
    of a few hundred ids decodes most of its tokens to nothing, and leaves its TTFT unmeasured)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def shape_run(
    device: str, plan: Plan, work: Path, name: str, shape: Shape, report: Report, quantization: str = "auto",
    baseline: int | None = None,
) -> dict:  # fmt: skip
    """The shape's figures; with `quantization` int4 (or int8) its weights quantized at load, and transformers'
    generate not run again (the dense run's is the baseline); baseline: transformers' generate only at batches up
    to this."""
    from server.bench.offline import active_weight_bytes, bench_model, random_prompts, run_requests

    path = work / name
    if not (path / "config.json").is_file():
        build_shape(shape, path, device)
    # async scheduling on, the GPU's default (on a CPU too, so that the small mode runs its figures' code)
    engine = engine_for(path, device, "bfloat16", max_num_seqs=max(plan.batches), kv_cache_memory=plan.kv_cache_memory,
                        max_num_batched_tokens=max(plan.ttft_prompt_len, 512), quantization=quantization,
                        async_scheduling=True)  # fmt: skip
    model = engine.runner.model
    params = sum(p.numel() for p in model.parameters())
    result = {"params": params, "dtype": str(engine.runner.dtype).removeprefix("torch."),
              "attention": type(engine.runner.attention).__name__, "weights": engine.runner.backend.weights.value,
              "gemm": type(model.lm_head.method).__name__}  # fmt: skip

    # batch 1: the step, against the bytes it must read
    single = bench_model(engine, plan.input_len, plan.output_len, runs=3)
    step_ms = 1e3 / single["decode_tokens_per_s"]
    context = plan.input_len + plan.output_len // 2
    kv_bytes = shape.kv_bytes_per_token * context
    floor_bytes = active_weight_bytes(model) + kv_bytes + shape.state_bytes_per_step
    bandwidth = report.get("copy_bandwidth").get("gb_per_s")
    result.update(decode_step_ms=round(step_ms, 3), decode_tokens_per_s_b1=single["decode_tokens_per_s"],
                  bytes_read_per_step=floor_bytes, async_scheduling=engine.async_scheduling)  # fmt: skip
    if engine.async_scheduling:  # the same steps, each read back before the next is scheduled
        engine.reset(async_scheduling=False)
        in_turn = bench_model(engine, plan.input_len, plan.output_len, runs=3)
        result["decode_step_ms_in_turn"] = round(1e3 / in_turn["decode_tokens_per_s"], 3)
        engine.reset(async_scheduling=True)
    if bandwidth:
        floor_ms = floor_bytes / (bandwidth * 1e9) * 1e3
        result.update(floor_ms=round(floor_ms, 4), step_over_floor=round(step_ms / floor_ms, 2),
                      bandwidth_utilisation=round(floor_ms / step_ms, 3))  # fmt: skip

    if device == "cuda":
        result.update(decode_anatomy(engine))
    for batch in (plan.batches[0], plan.batches[-1]):  # one alone, and the most
        result.update(host_anatomy(engine, batch, plan.input_len))

    # TTFT of a long prompt, against 2 x (the parameters a token multiplies by) x tokens at the H200's bfloat16 rate
    long = bench_model(engine, plan.ttft_prompt_len, 2, runs=2)
    ttft_s = plan.ttft_prompt_len / long["prefill_tokens_per_s"]
    result.update(ttft_prompt_len=plan.ttft_prompt_len, ttft_s=round(ttft_s, 4))
    if device == "cuda":
        floor_s = 2 * active_params(model) * plan.ttft_prompt_len / H200_BF16_FLOPS
        result.update(ttft_floor_s=round(floor_s, 5), ttft_over_floor=round(ttft_s / floor_s, 2))
        result.update(prefill_anatomy(engine, plan.ttft_prompt_len, shape.vocab))

    # batches: kvserve's engine against transformers' batched generate, the same prompts and lengths
    throughput, generate = {}, {}
    for batch in plan.batches:
        prompts = random_prompts(batch, plan.input_len, shape.vocab, seed=batch)
        engine.reset(max_num_seqs=batch)
        run = run_requests(engine, prompts, plan.output_len, f"b{batch}")
        throughput[batch] = round(run["output_tokens"] / run["wall_s"], 1)
        if quantization == "auto" and (baseline is None or batch <= baseline):
            generate[batch] = transformers_generate(path, device, prompts, plan.output_len)
    result["output_tokens_per_s"] = throughput
    if engine.async_scheduling:  # the most sequences, each step read back before the next is scheduled
        batch = plan.batches[-1]
        engine.reset(max_num_seqs=batch, async_scheduling=False)
        run = run_requests(engine, random_prompts(batch, plan.input_len, shape.vocab, seed=batch), plan.output_len,
                           f"b{batch}-in-turn")  # fmt: skip
        result["output_tokens_per_s_in_turn"] = {batch: round(run["output_tokens"] / run["wall_s"], 1)}
        engine.reset(async_scheduling=True)
    if generate:
        result.update(transformers_tokens_per_s=generate,
                      speedup_over_transformers={b: round(throughput[b] / generate[b], 2) for b in generate})  # fmt: skip
    result["graph_replay_share"] = graph_replay_share(engine)
    del engine, model
    _transformers_models.clear()
    release(device)
    return result


def active_params(model) -> int:
    """The parameters each token is multiplied by: all but an untied embedding (a row is looked up) and, of each
    sparse layer's experts, all but the top_k a token goes to."""
    total = sum(p.numel() for p in model.parameters())
    if model.embed is not model.lm_head:
        total -= sum(p.numel() for p in model.embed.parameters())
    for layer in model.layers:
        if hasattr(layer.mlp, "experts"):
            experts = sum(p.numel() for p in layer.mlp.experts.parameters())
            total -= experts - experts * layer.mlp.top_k // len(layer.mlp.experts)
    return total


def decode_anatomy(engine) -> dict:
    """Where a batch-1 decode step's time goes on the GPU: its graph replayed alone (CUDA events: the GPU's time,
    the host's per-step work left out), and the kernels one eager run of the same step launches (how many, their
    GPU time together, the costliest by name). A failure is reported in the section's result, not raised."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None or 1 not in graphs.graphs:
        return {}
    try:
        from torch.profiler import ProfilerActivity, profile

        graphs._fill([], [], [], [], 1)  # one dummy row, its K/V in the kept-back block
        with torch.inference_mode():
            for _ in range(3):
                graphs.graphs[1].replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                graphs.graphs[1].replay()
            end.record()
            torch.cuda.synchronize()
            graph_ms = start.elapsed_time(end) / 50
            graphs._forward(1)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graphs._forward(1)
                torch.cuda.synchronize()
        kernels = kernel_table(prof)
        return {"decode_graph_ms": round(graph_ms, 4), "eager_kernels": kernels["count"],
                "eager_kernel_ms": kernels["ms"], "top_kernels": kernels["top"]}  # fmt: skip
    except Exception as e:  # noqa: BLE001 (the section's other figures stand without it)
        return {"anatomy_error": f"{type(e).__name__}: {e}"}


def prefill_anatomy(engine, prompt_len: int, vocab: int) -> dict:
    """Where a long prompt's step goes on the GPU: its wall time, and its kernels by name under the profiler (how
    many, their GPU time together, the costliest), so the TTFT's distance from its compute floor is split between
    the GEMMs, attention, the rest, and the host. A failure is reported in the section's result, not raised."""
    try:
        from torch.profiler import ProfilerActivity, profile

        from server.bench.offline import random_prompts
        from server.engine.request import SamplingParams

        engine.reset()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request("prefill", random_prompts(1, prompt_len, vocab, seed=3)[0], params)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.step()  # the whole prompt: max_num_batched_tokens holds it
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        while engine.has_work():
            engine.step()
        kernels = kernel_table(prof)
        return {"prefill_step_ms": round(wall * 1e3, 3), "prefill_kernels": kernels["count"],
                "prefill_kernel_ms": kernels["ms"], "prefill_top_kernels": kernels["top"]}  # fmt: skip
    except Exception as e:  # noqa: BLE001 (the section's other figures stand without it)
        return {"prefill_anatomy_error": f"{type(e).__name__}: {e}"}


def kernel_table(prof) -> dict:
    """The GPU kernels a torch.profiler run saw: how many, their time together (ms), the 15 costliest by name
    ([name, count, microseconds])."""
    by_name: dict[str, list] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(event.name[:80], [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"count": sum(c for c, _ in by_name.values()), "ms": round(sum(us for _, us in by_name.values()) / 1e3, 4),
            "top": [[name, count, round(us, 1)] for name, (count, us) in top]}  # fmt: skip


def host_anatomy(engine, batch: int, prompt_len: int, steps: int = 20) -> dict:
    """Where the host's time goes in decode steps of `batch` sequences: the median step (wall), then the same steps
    under cProfile, the functions with the most time of their own per step. On a GPU the step waits once for the
    device (the event after its draws' copy to the host: the step before's, under async scheduling), so the time
    the host waits for the GPU shows as that wait's (`synchronize`)."""
    import cProfile
    import pstats

    from server.bench.offline import start_decoding, timed_steps

    engine.reset(max_num_seqs=max(batch, engine.config.max_num_seqs))
    start_decoding(engine, batch, prompt_len, 2 * steps + 8)
    times = timed_steps(engine, steps)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    engine.abort_all()
    own = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])[:10]
    top = [
        [f"{Path(file).name}:{line}({name})", round(tt / steps * 1e3, 3)]
        for (file, line, name), (_, _, tt, *_) in own
    ]
    return {f"host_step_ms_b{batch}": round(statistics.median(times) * 1e3, 3), f"host_top_b{batch}": top}


def graph_replay_share(engine) -> float | None:
    """The share of decode steps replayed from CUDA graphs: None where the runner recorded none (a CPU,
    --enforce-eager, a model whose steps cannot be recorded, a failed capture: the start log says which)."""
    if getattr(engine.runner, "graphs", None) is None:
        return None
    replayed, eager = engine.runner.graph_stats()
    return round(replayed / max(replayed + eager, 1), 3)


_transformers_models: dict = {}


def transformers_generate(path: Path, device: str, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s of transformers' batched generate (greedy, bfloat16, no compile), one warm-up first."""
    import transformers

    key = (str(path), device)
    if key not in _transformers_models:
        _transformers_models.clear()
        _transformers_models[key] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16).to(device).eval()  # fmt: skip
    model = _transformers_models[key]
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  min_new_tokens=output_len, max_new_tokens=output_len)  # fmt: skip
    with torch.no_grad():
        model.generate(ids[:, :8], **{**kwargs, "min_new_tokens": 2, "max_new_tokens": 2})
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        sync(device)
    return round((out.shape[1] - ids.shape[1]) * len(prompts) / (time.perf_counter() - start), 1)


def http(device: str, plan: Plan, work: Path) -> dict:
    """The largest shape served over HTTP; `kvserve bench` (random prompts) at each concurrency."""
    name = list(plan.shapes)[-1]
    path = work / name
    if not (path / "config.json").exists():
        build_shape(plan.shapes[name], path, device)
    port = free_port()
    args = [sys.executable, "-m", "server.cli", "serve", "--model", str(path), "--device", device,
            "--dtype", "bfloat16", "--port", str(port), "--speculative-config", "off",
            "--kv-cache-memory", str(plan.kv_cache_memory)]  # fmt: skip
    log = (work / "serve.log").open("w")
    server = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(port, server, work / "serve.log")
        runs = {}
        for concurrency in plan.http_concurrency:
            bench = subprocess.run(
                [sys.executable, "-m", "server.cli", "bench", "--url", f"http://127.0.0.1:{port}",
                 "--concurrency", str(concurrency), "--num-requests", str(max(plan.http_requests, 2 * concurrency)),
                 "--input-len", str(plan.input_len), "--output-len", str(plan.output_len)],
                cwd=REPO, capture_output=True, text=True, timeout=240,
            )  # fmt: skip
            if bench.returncode != 0:
                raise RuntimeError(
                    f"kvserve bench c{concurrency}: {bench.stdout[-1500:]}{bench.stderr[-1500:]}"
                )
            runs[f"c{concurrency}"] = last_json(bench.stdout)
        return {"model": name, **runs}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, server: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}): {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health in {timeout} s: {log.read_text()[-3000:]}")


def last_json(text: str) -> dict:
    """The last JSON object line of a command's output."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in: {text[-1500:]}")


if __name__ == "__main__":
    sys.exit(main())
