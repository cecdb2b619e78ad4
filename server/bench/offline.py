"""Offline benchmarks: the model alone (prefill, single-stream decode), where a decode step's time goes, the
engine under concurrency, and the quality of a quantized model against its float32 reference."""

import dataclasses
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch

from model.attention_cpu import KERNEL_CHUNK
from model.deltanet import StepStates
from server.engine.engine import Engine
from server.engine.request import GrammarSpec, SamplingParams


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of random ordinary tokens (ids past the first few hundred avoid special tokens)."""
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


def run_requests(
    engine: Engine, prompts: list[list[int]], output_len: int, tag: str, params: SamplingParams | None = None
) -> dict:
    """Run all prompts to completion (by default greedy, ignore_eos, fixed length); per-request timings in
    seconds."""
    params = params or SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    times = []
    num_tokens = 0
    scheduler = engine.scheduler
    cache = engine.runner.kv_cache
    per_block = cache.bytes_per_block(engine.model_config, cache.block_size, cache.k.dtype)
    # a hybrid's DeltaNet state: one per running request, whatever its length
    per_state = cache.bytes_per_state_slot(engine.model_config)
    bm = scheduler.block_manager
    # (bytes of the cache held by requests, their tokens with K/V) where the bytes peaked
    peak = (0, 0)
    while engine.has_work():
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
            if out.finished:
                times.append(out.times)
        held = (bm.num_blocks - bm.num_free_blocks) * per_block  # O(1): a step of the benchmark is not slowed
        held += (bm.num_state_slots - len(bm.free_state_slots)) * per_state
        if held > peak[0]:
            peak = (held, sum(r.num_computed_tokens for r in scheduler.running))
    wall = time.monotonic() - start
    return {"wall_s": wall, "output_tokens": num_tokens, "times": times, "kv_peak": peak}


def bench_offline(
    engine: Engine, num_requests: int, input_len: int, output_len: int, baseline_requests: int | None
) -> dict:
    vocab = engine.vocab_size
    run_requests(engine, random_prompts(2, input_len, vocab, seed=1), min(output_len, 8), "warmup")
    prompts = random_prompts(num_requests, input_len, vocab)
    max_num_seqs = engine.config.max_num_seqs
    engine.reset()  # an empty prefix cache
    main = run_requests(engine, prompts, output_len, "bench")
    result = {
        "requests": num_requests,
        "max_num_seqs": engine.config.max_num_seqs,
        "input_len": input_len,
        "output_len": output_len,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": str(engine.runner.device),
        "wall_s": round(main["wall_s"], 2),
        "output_tokens_per_s": round(main["output_tokens"] / main["wall_s"], 1),
    }
    # what the running requests' K/V (and a hybrid's DeltaNet states) took where it took most: with sliding-window
    # layers, less per token the longer the sequences (block_manager.py gives back what leaves the window)
    kv_bytes, kv_tokens = main["kv_peak"]
    result["kv_cache_peak_mib"] = round(kv_bytes / 2**20, 2)
    if kv_tokens:
        result["kv_bytes_per_token_at_peak"] = round(kv_bytes / kv_tokens)
    ttft = [t.first_token - t.arrival for t in main["times"]]
    result["ttft_p50_s"] = round(statistics.median(ttft), 3)
    n_base = num_requests if baseline_requests is None else min(baseline_requests, num_requests)
    if n_base > 0:
        engine.reset(max_num_seqs=1)
        base = run_requests(engine, prompts[:n_base], output_len, "baseline")
        result["baseline_requests"] = n_base
        result["baseline_output_tokens_per_s"] = round(base["output_tokens"] / base["wall_s"], 1)
        result["speedup"] = round(result["output_tokens_per_s"] / result["baseline_output_tokens_per_s"], 2)
    engine.reset(max_num_seqs=max_num_seqs)
    return result


# Records of whatever the model makes up: a JSON schema whose output never ends before max_tokens (minItems), so
# that constrained and free requests generate as many tokens.
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 10_000,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "score": {"type": "integer"}, "tags": {"type": "array"}},
        "required": ["name", "score"],
    },
}


def bench_structured(
    engine: Engine, schema: dict, num_requests: int, input_len: int, output_len: int, rounds: int
) -> dict:
    """Throughput with every request constrained by a JSON schema against the same requests free, the two
    alternated `rounds` times (drift hits both alike); medians."""
    grammar = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(schema)))
    free = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    runs = {"free": free, "json_schema": dataclasses.replace(free, grammar=grammar)}
    prompts = random_prompts(num_requests, input_len, engine.vocab_size)
    for name, params in runs.items():  # warm-up
        run_requests(engine, prompts[:2], output_len, f"warmup-{name}", params)
    tokens_per_s: dict[str, list[float]] = {name: [] for name in runs}
    num_tokens: dict[str, int] = {}
    for r in range(rounds):
        for name, params in runs.items():
            engine.reset()  # an empty prefix cache
            result = run_requests(engine, prompts, output_len, f"{name}-{r}", params)
            tokens_per_s[name].append(result["output_tokens"] / result["wall_s"])
            num_tokens[name] = result["output_tokens"]
    free_tps, constrained_tps = (statistics.median(tokens_per_s[n]) for n in runs)
    return {
        "requests": num_requests,
        "max_num_seqs": engine.config.max_num_seqs,
        "input_len": input_len,
        "output_len": output_len,
        "rounds": rounds,
        "free_output_tokens_per_s": round(free_tps, 1),
        "json_schema_output_tokens_per_s": round(constrained_tps, 1),
        "json_schema_output_tokens": num_tokens[
            "json_schema"
        ],  # the same as free's, or the grammar ended some
        "free_output_tokens": num_tokens["free"],
        "cost_percent": round(100 * (1 - constrained_tps / free_tps), 1),
    }


def bench_model(engine: Engine, prompt_len: int, output_len: int, runs: int) -> dict:
    """Prefill tokens/s (one prompt) and single-stream decode tokens/s (prefill excluded), medians of `runs`."""
    vocab = engine.vocab_size
    prefill, decode = [], []
    for i in range(runs + 1):  # run 0 is the warm-up
        engine.reset()  # no prefix-cache hits between runs
        r = run_requests(engine, random_prompts(1, prompt_len, vocab, seed=100 + i), output_len, f"m{i}")
        t = r["times"][0]
        if i == 0:
            continue
        prefill.append(prompt_len / (t.first_token - t.scheduled))
        decode.append((output_len - 1) / (t.finish - t.first_token))
    return {
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": str(engine.runner.device),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "runs": runs,
        "prefill_tokens_per_s": round(statistics.median(prefill), 1),
        "decode_tokens_per_s": round(statistics.median(decode), 1),
    }


def bench_steps(engines: dict[str, Engine], batch_size: int, input_len: int, steps: int) -> dict:
    """Median decode step time of each engine at `batch_size` sequences, the engines' steps interleaved so
    that the machine's drift hits them alike. Returns tokens/s per engine name (bench-invariance compares
    batch invariance on and off, bench-kernels the C++ CPU kernels and PyTorch ops)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for name, engine in engines.items():
        engine.reset()
        ids = {f"{name}-{i}" for i in range(batch_size)}
        for rid, p in zip(sorted(ids), random_prompts(batch_size, input_len, engine.vocab_size), strict=True):
            engine.add_request(rid, p, params)
        while ids:  # prefill, until every sequence decodes
            ids -= {out.request_id for out in engine.step()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        while engine.has_work():
            engine.step()
    return {
        "batch_size": batch_size,
        **{f"{name}_tokens_per_s": round(batch_size / statistics.median(t), 1) for name, t in times.items()},
    }


def weight_bytes(module) -> int:
    """The bytes a module's weights take as they run: parameters and buffers (quantized, packed), and oneDNN's
    packed copies (attributes of their Linear); a weight let go for its packed form (a meta tensor) takes none."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [m.packed for m in module.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    # each tensor once: a quantized Linear's `packed` is a buffer and an attribute
    unique = {id(t): t for t in tensors if t.device.type != "meta"}
    return sum(t.numel() * t.element_size() for t in unique.values())


def active_weight_bytes(model) -> int:
    """The weight bytes one token's decode step reads: every block's, the final norm and the LM head, but of each
    sparse FFN only top_k / num_experts of its experts (a token reads its k; the router and a shared expert
    whole), and of an untied embedding (and Gemma 4's per-layer embeddings) only a row."""
    total = weight_bytes(model)
    if model.embed is not model.lm_head:
        total -= weight_bytes(model.embed)
    if model.per_layer_embed is not None:
        total -= weight_bytes(model.per_layer_embed)
    for layer in model.layers:
        if hasattr(layer.mlp, "experts"):
            experts = weight_bytes(layer.mlp.experts)
            total -= experts - experts * layer.mlp.top_k // len(layer.mlp.experts)
    return total


def read_ms(num_bytes: int, reps: int = 5) -> float:
    """Median time to read num_bytes once (a float32 sum over them, on torch's threads): what the memory gives a
    step that only read its weights, measured on this host now."""
    data = torch.ones(max(num_bytes // 4, 1))
    data.sum()  # its pages in
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


# a block's GEMMs, by name: which Linear of its mixer (model/transformer.py's attention, or model/deltanet.py's
# Gated DeltaNet), of its dense FFN and of its per-layer input (Gemma 4)
ATTENTION_GEMMS = {"qkv": "qkv", "o": "o"}
DELTANET_GEMMS = {"in_proj": "in_proj", "out": "out"}
FFN_GEMMS = {"gate_up": "up", "down": "down"}
PER_LAYER_GEMMS = {"per_layer_gate": "per_layer_gate", "per_layer_proj": "per_layer_projection"}


def block_gemms(layer) -> list[tuple[str, object]]:
    """A block's GEMMs in the order it runs them, by name; a sparse FFN's are not among them (moe_ffn)."""
    mixer = DELTANET_GEMMS if layer.linear else ATTENTION_GEMMS
    gemms = [(name, getattr(layer.attn, attr)) for name, attr in mixer.items()]
    if not hasattr(layer.mlp, "experts"):
        gemms += [(name, getattr(layer.mlp, attr)) for name, attr in FFN_GEMMS.items()]
    if layer.per_layer_gate is not None:
        gemms += [(name, getattr(layer, attr)) for name, attr in PER_LAYER_GEMMS.items()]
    return gemms


def start_decoding(engine: Engine, batch_size: int, context_len: int, max_tokens: int) -> list[str]:
    """batch_size random prompts of context_len tokens added to an emptied engine (greedy, max_tokens each) and
    stepped until every one decodes; their request ids."""
    engine.reset()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"step-{i}" for i in range(batch_size)]
    for rid, prompt in zip(ids, random_prompts(batch_size, context_len, engine.vocab_size), strict=True):
        engine.add_request(rid, prompt, params)
    prefilling = set(ids)
    while prefilling:
        prefilling -= {out.request_id for out in engine.step()}
    return ids


def timed_steps(engine: Engine, steps: int) -> list[float]:
    """Each of the engine's next `steps` steps' wall time, in seconds."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def bench_profile(engine: Engine, batch_size: int, context_len: int, steps: int, reps: int) -> dict:
    """Where a decode step's time goes. The engine's own step (median of `steps`, `batch_size` sequences of
    ~context_len tokens each), then its parts replayed alone on the model's own weights and KV cache, in the
    order a step runs them (the weights as cold as a step finds them): the block GEMMs by shape, the LM head,
    attention (RoPE and K/V stores included), RMSNorm and SwiGLU, a MoE model's sparse FFNs whole (router,
    experts, sum: `moe_ffn`) and a hybrid's Gated DeltaNet between its projections (convolution, delta rule,
    gated norm: `deltanet`); medians of `reps` replays. The step is set against one plain read of the weight
    bytes a token's step reads (`active_weight_mib`; a MoE layer's chosen experts only): at batch 1,
    step_over_read is how far the step is from the memory's floor. The rest is the
    step around the model: scheduling, metadata, embedding rows, RoPE tables, sampling and detokenizing."""
    ids = start_decoding(engine, batch_size, context_len, steps + 8)
    times = timed_steps(engine, steps)
    for rid in ids:
        engine.abort(rid)
    engine.step()

    runner = engine.runner
    model, dtype, B = runner.model, runner.dtype, batch_size
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(runner.device, dtype)

    # the block GEMMs in the order a step runs them; a sparse layer's FFN (model/moe.py: router, the chosen
    # experts' GEMMs, the weighted sum) is timed whole, as moe_ffn
    sparse = [layer for layer in model.layers if hasattr(layer.mlp, "experts")]
    deltanet = [i for i, layer in enumerate(model.layers) if layer.linear]  # Gated DeltaNet mixers
    attention = [i for i, layer in enumerate(model.layers) if not layer.linear]
    # by name and shape: a family's layers may differ (Gemma 4's full layers' heads, its double-wide MLPs)
    schedule = [
        (f"{name} {linear.out_features}x{linear.in_features}", linear)
        for layer in model.layers
        for name, linear in block_gemms(layer)
    ]
    blocks: dict[str, list] = {}
    for name, linear in schedule:
        blocks.setdefault(name, []).append(linear)
    inputs = {name: rand(B, linears[0].in_features) for name, linears in blocks.items()}
    head_input = rand(B, model.lm_head.in_features)
    # B sequences of context_len + 1 tokens in blocks of the cache (a table per KV group), each decoding its next
    # token
    block_size, G = runner.kv_cache.block_size, len(model.config.kv_groups)
    n = -(-(context_len + 1) // block_size)
    tables = [[list(range((i * G + g) * n, (i * G + g + 1) * n)) for g in range(G)] for i in range(B)]
    positions, meta = runner.attention.build([1] * B, [context_len + 1] * B, tables)

    def attention_inputs(layer) -> tuple:
        """(q, k, v, rope) of one decode row per sequence for a layer's attention: its own heads (Gemma 4's full
        layers have theirs), no k and v where it reads another layer's; the kernel rotates full-width heads, a
        partial rotary's first dims turn before it (model/transformer.py)."""
        attn = layer.attn
        q, k, v = (
            rand(B, attn.num_heads, attn.head_dim),
            *(rand(B, attn.num_kv_heads, attn.head_dim) for _ in "kv"),
        )
        rotates = layer.rope is not None and attn.rotary_dim == attn.head_dim and not attn.reads_kv
        rope = model.rope(layer.rope, positions, dtype) if rotates else None
        return (q, None, None, rope) if attn.reads_kv else (q, k, v, rope)

    inputs_of = {i: attention_inputs(model.layers[i]) for i in attention}
    hidden, residual = rand(B, model.config.hidden_size), rand(B, model.config.hidden_size)
    gate_up = next((linears[0] for name, linears in blocks.items() if name.startswith("gate_up ")), None)
    up = rand(B, gate_up.out_features) if gate_up is not None else None  # none: all sparse
    per_call: dict[str, list[float]] = {name: [] for name in blocks}
    totals: dict[str, list[float]] = {
        "block_gemms": [],
        "lm_head": [],
        "attention": [],
        "norms_and_swiglu": [],
        **({"moe_ffn": []} if sparse else {}),
        **({"deltanet": []} if deltanet else {}),
    }
    if deltanet:  # B decoding sequences in the first B state slots (nobody holds them: the requests ended)
        states = StepStates(list(range(B)), [1] * B, list(range(B)), [context_len] * B)
        proj = rand(B, model.layers[deltanet[0]].attn.in_proj.out_features)

    def timed(fn, *args) -> float:  # a GPU's queued work finished before and after
        runner.backend.synchronize()
        start = time.perf_counter()
        fn(*args)
        runner.backend.synchronize()
        return time.perf_counter() - start

    def norms_and_swiglu(layer) -> None:  # a block's two norms (with their residual adds) and its activation
        layer.norm1.add_forward(hidden, residual)
        layer.norm2.add_forward(hidden, residual)
        if layer not in sparse:
            layer.mlp.activation(up)

    with torch.inference_mode():
        for _ in range(reps + 1):  # the first is a warm-up
            gemms = 0.0
            for name, linear in schedule:
                t = timed(linear, inputs[name])
                per_call[name].append(t)
                gemms += t
            totals["block_gemms"].append(gemms)
            totals["lm_head"].append(timed(model.lm_head.logits, head_input))
            totals["attention"].append(
                sum(timed(meta[runner.kv_cache.group_of[i]].attend, *inputs_of[i][:3], *runner.kv_cache.layer(i),
                          inputs_of[i][3], model.layers[i].attn.scale, model.layers[i].attn.window)
                    for i in attention)
            )  # fmt: skip
            totals["norms_and_swiglu"].append(sum(timed(norms_and_swiglu, layer) for layer in model.layers))
            if sparse:
                totals["moe_ffn"].append(
                    sum(timed(layer.mlp, hidden, *[hidden] * layer.ffn_reads_stream) for layer in sparse)
                )
            if deltanet:
                totals["deltanet"].append(
                    sum(
                        timed(model.layers[i].attn.mix, proj, *runner.kv_cache.layer(i), states)
                        for i in deltanet
                    )
                )
    step_ms = 1e3 * statistics.median(times)
    parts = {name: 1e3 * statistics.median(ts[1:]) for name, ts in totals.items()}
    active = active_weight_bytes(model)
    read = read_ms(active)
    # milliseconds to the microsecond: a tiny model's parts and read take a few (0.004 ms on a fast host)
    return {
        "batch_size": B,
        "context_len": context_len,
        "dtype": str(dtype).removeprefix("torch."),
        "step_ms": round(step_ms, 3),
        # a lone step against one read of what it must read (a floor: the weights a token touches, read once)
        "active_weight_mib": round(active / 2**20, 1),
        "weights_read_ms": round(read, 3),
        "step_over_read": round(step_ms / read, 2),
        **{f"{name}_ms": round(ms, 3) for name, ms in parts.items()},
        "rest_ms": round(step_ms - sum(parts.values()), 3),
        "gemm_us_per_call": {
            name: round(1e6 * statistics.median(ts[len(blocks[name]) :]), 1) for name, ts in per_call.items()
        },
    }


def bench_gemms(engine: Engine, rows: int, reps: int) -> dict:
    """The model's GEMMs at `rows` rows (a decode step's batch, or a prefill chunk's tokens): each block GEMM
    shape (the first layer's) and the LM head as the engine runs them, and torch's oneDNN bfloat16 GEMM on the
    same weights dequantized, packed once (what the CPU gives without quantization: on AMX, oneDNN's tiles);
    alternated, medians of `reps`. block_gemms_ms is a whole step's: each shape times the layers. Where the run
    computes a prompt's rows apart (the amx tier's prompt GEMMs: ModelRunner.prompt_gemms), those too
    (kvserve_prompt: the weights dequantized to bfloat16 a step at a time, on AMX's tiles)."""
    from model.linear import OneDnnLinear

    model = engine.runner.model
    linears = {}  # each GEMM shape's first layer's
    for layer in model.layers:
        for name, linear in block_gemms(layer):
            linears.setdefault(name, linear)
    linears["lm_head"] = model.lm_head
    compare = OneDnnLinear.available(torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    times: dict[str, dict[str, list[float]]] = {}

    def timed(runs: dict) -> dict[str, list[float]]:  # alternated, the first of each a warm-up
        ts: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(reps + 1):
            for k, run in runs.items():
                start = time.perf_counter()
                run()
                ts[k].append(time.perf_counter() - start)
        return ts

    with torch.inference_mode():
        for name, linear in linears.items():
            x = torch.randn(rows, linear.in_features, generator=g).to(engine.runner.dtype)
            runs = {"kvserve": lambda linear=linear, x=x: linear(x)}
            if engine.runner.prompt_gemms and linear is not model.lm_head:
                prompt = linear.method.kernels.quant_gemm_dequantized
                runs["kvserve_prompt"] = lambda linear=linear, x=x, prompt=prompt: prompt(x, linear.gemm)
            if compare and getattr(linear, "bits", None):  # quantized: its exact weights, dense in bfloat16
                dense = linear.rows(torch.arange(linear.out_features), torch.float32).to(torch.bfloat16)
                packed = torch.ops.mkldnn._reorder_linear_weight(dense, 1)
                xb = x.to(torch.bfloat16)
                runs["onednn_bf16"] = lambda packed=packed, xb=xb: torch.ops.mkldnn._linear_pointwise(
                    xb, packed, None, "none", [], ""
                )
            times[name] = timed(runs)
        kernel = getattr(engine.runner.attention, "kernel", None)  # the C++ paged attention, where it runs
        if kernel is not None:
            times["attention"] = timed(prompt_attention(engine, kernel, rows, g))
    ms = {name: {k: 1e3 * statistics.median(ts[1:]) for k, ts in by.items()} for name, by in times.items()}
    attention = ms.pop("attention", {})
    layers = len(model.layers)
    result = {"rows": rows, "dtype": str(engine.runner.dtype).removeprefix("torch.")}
    for k in ("kvserve", "kvserve_prompt", "onednn_bf16"):
        if all(k in by for name, by in ms.items() if name != "lm_head"):
            result[f"{k}_block_gemms_ms"] = round(
                layers * sum(by[k] for n, by in ms.items() if n != "lm_head"), 3
            )
        if k in ms["lm_head"]:
            result[f"{k}_lm_head_ms"] = round(ms["lm_head"][k], 3)
    if "onednn_bf16_block_gemms_ms" in result:
        result["block_gemms_speedup"] = round(
            result["onednn_bf16_block_gemms_ms"] / result["kvserve_block_gemms_ms"], 2
        )
        if "kvserve_prompt_block_gemms_ms" in result:
            result["prompt_block_gemms_speedup"] = round(
                result["onednn_bf16_block_gemms_ms"] / result["kvserve_prompt_block_gemms_ms"], 2
            )
    for k, t in attention.items():  # a prompt of `rows` tokens attending to itself, every layer
        result[f"{k}_attention_ms"] = round(layers * t, 3)
    result["us_per_call"] = {
        f"{name} {linears[name].out_features}x{linears[name].in_features}": {
            k: round(1e3 * v, 1) for k, v in by.items()
        }
        for name, by in ms.items()
    }
    return result


def prompt_attention(engine: Engine, kernel, rows: int, g: torch.Generator) -> dict:
    """One layer's attention of a prompt of `rows` tokens over its own keys (the first layer's heads, the
    engine's cache dtype and block size), as the step runs it: on vectors (kvserve) and, where the run computes a
    prompt's rows apart, on AMX's tiles (kvserve_prompt)."""
    config, cache = engine.runner.model_config, engine.runner.kv_cache
    H, KVH, D, bs = config.num_heads, config.num_kv_heads, config.head_dim, cache.block_size
    blocks = (rows + bs - 1) // bs
    q = torch.randn(rows, H, D, generator=g).to(engine.runner.dtype)
    k_cache, v_cache = (torch.randn(KVH, blocks * bs, D, generator=g).to(cache.k.dtype) for _ in range(2))
    table = torch.arange(blocks, dtype=torch.int32)[None]
    seqs = torch.tensor([[0, rows, rows]], dtype=torch.int32)
    args = (
        q,
        k_cache,
        v_cache,
        table,
        seqs,
        bs,
        D**-0.5,
        0,
        0.0,
        KERNEL_CHUNK,
        None,
        None,
        None,
        None,
        None,
        None,
    )
    runs = {"kvserve": lambda: kernel(*args)}
    if engine.runner.prompt_gemms:
        prompt_rows = torch.tensor([[0, rows]])
        runs["kvserve_prompt"] = lambda: kernel(*args, prompt_rows)
    return runs


# ~3,000 tokens of varied English, in server/data (shipped as the server package's data)
DEFAULT_QUALITY_TEXT = Path(__file__).parents[1] / "data" / "quality.txt"
FRANCE = "What is the capital of France?"


def bench_quality(test: Engine, reference: Engine, text: str, window: int) -> dict:
    """How far the test engine's next-token distributions are from the reference's over a text: mean
    KL(reference || test) per position, how often their most likely tokens agree, and each one's perplexity
    on the text (llama.cpp's --kl-divergence measures the same). The text is read in windows of `window`
    tokens, each a fresh sequence, so both see exactly the same inputs (each after BOS where the tokenizer adds
    one: Gemma's outputs fall apart without it)."""
    ids = test.tokenizer.encode(text)
    bos = test.tokenizer.encode("", add_special_tokens=True)
    kld, agree, nll_test, nll_ref, n = 0.0, 0, 0.0, 0.0, 0
    for start in range(0, len(ids) - 1, window - len(bos)):
        chunk = bos + ids[start : start + window - len(bos)]
        if len(chunk) < 2:
            break
        # [n - 1, vocab] on the host: the two engines may run on different devices
        p = torch.log_softmax(reference.score(chunk).double().cpu(), dim=-1)[:-1]
        q = torch.log_softmax(test.score(chunk).double().cpu(), dim=-1)[:-1]
        target = torch.tensor(chunk[1:])[:, None]
        kld += (p.exp() * (p - q)).sum().item()
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        nll_ref -= p.gather(1, target).sum().item()
        nll_test -= q.gather(1, target).sum().item()
        n += len(chunk) - 1
    return {
        "tokens": n,
        "mean_kld": round(kld / n, 6),
        "top1_agreement": round(agree / n, 4),
        "perplexity": round(math.exp(nll_test / n), 3),
        "reference_perplexity": round(math.exp(nll_ref / n), 3),
        "france": answer(test, FRANCE),
    }


def answer(engine: Engine, question: str, max_tokens: int = 24) -> str:
    """The engine's greedy answer to one chat question; a model without a chat template (a base model)
    continues the question's text."""
    tok = engine.tokenizer
    if tok.has_chat_template:
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    else:
        prompt = tok.encode(question, add_special_tokens=True)
    engine.add_request("question", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text = ""
    while engine.has_work():
        text += "".join(o.text for o in engine.step())
    return text


def print_json(result: dict) -> None:
    print(json.dumps(result), flush=True)
