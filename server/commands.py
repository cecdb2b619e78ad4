"""What each kvserve command does, and how it builds the layers from the parsed flags (server/cli.py parses)."""

import gc
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("kvserve")
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


# --- building the layers -------------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """'2GiB', '512MB', '1.5G', or a plain number of bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
             "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}  # fmt: skip
    s = str(text).strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num) :].strip()
    if unit not in units or not num:
        raise ValueError(f"cannot read {text!r} as a size (use e.g. 2GiB, 512MiB, 1.5GB)")
    return int(float(num) * units[unit])


def resolve_model(args):
    """The model to load: --model's folder, --model's GGUF file read in place, or the embedded default's GGUF
    (fetched first when absent), as the engine takes it (a path, or a source: model/loader.py)."""
    from weights.fetch import FetchError, default_gguf
    from weights.gguf_source import GGUFSource
    from weights.store import weights_dir

    if args.model and args.model.endswith(".gguf"):
        if not Path(args.model).is_file():
            raise FetchError(f"no such GGUF file: {args.model}")
        return GGUFSource(args.model)
    if args.model:
        return args.model
    return GGUFSource(default_gguf(weights_dir(args.weights_dir)))


def engine_config(args, **overrides):
    from server.engine.config import EngineConfig

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        batch_invariant=args.batch_invariant,
        async_scheduling=args.async_scheduling,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        cpu_kernels=args.cpu_kernels,
        cpu_tier=args.cpu_tier,
        gemm_activations=args.gemm_activations,
        prefill_gemms=args.prefill_gemms,
        speculative=speculative_config(args.speculative_config),
        task=args.task,
        pooling=args.pooling,
    )
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def speculative_config(text: str | None):
    """--speculative-config: "auto" (or not given) as it is (the engine decides: server/engine/setup.py,
    select_speculation), "off" as None, a JSON object as a SpeculativeConfig; exits naming the flag when it is
    none of them."""
    from server.engine.config import SpeculativeConfig

    text = (text or "auto").strip()
    if text in ("auto", "off"):
        return "auto" if text == "auto" else None
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("must be a JSON object")
        return SpeculativeConfig(**fields)
    except (ValueError, TypeError) as e:  # bad JSON, an unknown key, a value out of range
        raise SystemExit(f"--speculative-config: {e}") from None


def build_engine(args, **overrides):
    from server.engine.engine import Engine

    return Engine(resolve_model(args), engine_config(args, **overrides), args.chat_template)


def server_config(args, model_path: str | None):
    from server.api.config import ServerConfig

    path = Path(model_path) if model_path else None
    names = args.served_model_name or [path.name.removesuffix(".gguf") if path else DEFAULT_MODEL_NAME]
    names = names.split() if isinstance(names, str) else names  # from KVSERVE_SERVED_MODEL_NAME
    return ServerConfig(
        served_model_name=names[0],
        model_aliases=list(dict.fromkeys(n for n in names[1:] if n != names[0])),
        log_requests=not getattr(args, "disable_log_requests", False),
        api_key=args.api_key,
        allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()],
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
        responses_store_memory=parse_size(args.responses_store_memory),
        read_timeout=args.read_timeout,
        shutdown_timeout=args.shutdown_timeout,
        system_prompt=args.system_prompt,
        ui=not args.no_ui,
        reasoning_parser=args.reasoning_parser,
    )


def vllm_flags(args) -> None:
    """Read the flags a `vllm serve` command line passes (cli.VLLM_FLAGS) into kvserve's own, say what those that
    change nothing here mean, and raise ValueError naming one that asks for what kvserve does not do."""
    if args.model_tag:
        if args.model and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.download_dir:
        if args.weights_dir and args.weights_dir != args.download_dir:
            raise ValueError("give --weights-dir or --download-dir, not both")
        args.weights_dir = args.download_dir
    for flag, size in (("tensor", args.tensor_parallel_size), ("pipeline", args.pipeline_parallel_size),
                       ("data", args.data_parallel_size)):  # fmt: skip
        if size != 1:
            raise ValueError(f"--{flag}-parallel-size {size}: kvserve runs on one GPU or the CPU")
    parser = args.tool_call_parser
    if parser is not None and parser not in TOOL_CALL_CONVENTIONS:
        raise ValueError(
            f"--tool-call-parser {parser}: kvserve reads tool calls written as "
            f"{', '.join(TOOL_CALL_CONVENTIONS)} (whichever the model writes), not {parser}'s"
        )
    if args.enable_chunked_prefill is False:
        log.info(
            "--no-enable-chunked-prefill: kvserve always chunks prompts (--max-num-batched-tokens a step)"
        )
    taken = [name for name, given in (("--enable-auto-tool-choice", args.enable_auto_tool_choice),
                                      ("--tool-call-parser", parser is not None),
                                      ("--trust-remote-code", args.trust_remote_code)) if given]  # fmt: skip
    if taken:
        log.info(
            "%s: taken; kvserve parses calls under tool_choice auto and runs no checkpoint code",
            ", ".join(taken),
        )


# vLLM's --tool-call-parser names for the conventions kvserve reads (server/api/tools.py, server/api/reasoning.py)
TOOL_CALL_CONVENTIONS = ("hermes", "openai", "gemma4")


# --- the commands --------------------------------------------------------------------------------


def cmd_serve(args) -> int:
    import threading

    import uvicorn

    from server.api.app import create_app, set_engine
    from server.api.uvicorn_server import (
        DrainingServer,
        guarded_http,
        log_stats_periodically,
        raise_open_files_limit,
    )
    from server.engine.async_engine import AsyncEngine

    vllm_flags(args)
    engine_config(args)  # a bad flag value exits now, before the listener starts
    app = create_app(None, server_config(args, args.model))
    # ws="none": kvserve serves no WebSocket route, and uvicorn's default imported the websockets package at
    # start (~0.23 s of a ~3 s start, measured with python -X importtime)
    http = guarded_http(app.state.config.read_timeout, raise_open_files_limit())
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level or args.log_level,
        access_log=False,
        ws="none",
        http=http,
        root_path=args.root_path,
    )
    server = DrainingServer(config, app)
    failed = threading.Event()

    def load() -> None:  # the listener is up meanwhile: /health answers 503 until the engine is set
        try:
            engine = AsyncEngine(lambda: build_engine(args, seed=args.seed))  # built on its stepping thread
        except Exception as e:
            log.error("could not load the model: %s", e, exc_info=args.log_level == "debug")
            failed.set()
            server.should_exit = True
            return
        # Everything alive now (torch, the model, the tokenizer: ~400k objects) lives as long as the server. A full
        # collection walked them all, ~180 ms with the GIL held, stalling every stream; frozen, it skips them.
        gc.collect()
        gc.freeze()
        set_engine(app, engine)
        url = f"http://{args.host}:{args.port}"
        page = "" if args.no_ui else f", chat page at {url}/"
        log.info("ready: serving %s at %s/v1%s", app.state.config.served_model_name, url, page)
        if not args.disable_log_stats:
            log_stats_periodically(engine, server)

    threading.Thread(target=load, name="kvserve-load", daemon=True).start()
    server.run()
    if app.state.engine is not None:
        app.state.engine.shutdown()
    return 1 if failed.is_set() or not server.started else 0


def cmd_generate(args) -> int:
    from server.engine.request import SamplingParams

    engine = build_engine(args)
    tok = engine.tokenizer
    if args.raw or not tok.has_chat_template:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    engine.add_request("generate", tok.encode(prompt), params)
    while engine.has_work():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_fetch(args) -> int:
    from weights.fetch import default_gguf
    from weights.store import weights_dir

    print(default_gguf(weights_dir(args.weights_dir)))
    return 0


def cmd_convert_gguf(args) -> int:
    from weights.gguf_convert import convert_gguf

    convert_gguf(Path(args.src), Path(args.dst))
    print(args.dst)
    return 0


def cmd_openapi(args) -> int:
    from server.api.app import create_app
    from server.api.config import ServerConfig
    from server.api.openapi import openapi_yaml

    sys.stdout.write(openapi_yaml(create_app(None, ServerConfig())))
    return 0


def cmd_chat(args) -> int:
    from client.chat import chat_loop

    return chat_loop(args.url, args.model, args.api_key, args.system, args.max_tokens, args.temperature)


def cmd_bench(args) -> int:
    import asyncio

    from server.bench.http import bench_http

    asyncio.run(bench_http(args))
    return 0


def cmd_soak(args) -> int:
    from server.bench.soak import cmd_soak as soak

    return soak(args)


def cmd_bench_offline(args) -> int:
    from server.bench.offline import bench_offline, print_json

    engine = build_engine(args)
    print_json(
        bench_offline(engine, args.num_requests, args.input_len, args.output_len, args.baseline_requests)
    )
    return 0


def cmd_bench_structured(args) -> int:
    from server.bench.offline import BENCH_SCHEMA, bench_structured, print_json

    schema = json.loads(Path(args.schema).read_text(encoding="utf-8")) if args.schema else BENCH_SCHEMA
    engine = build_engine(args)
    print_json(
        bench_structured(engine, schema, args.num_requests, args.input_len, args.output_len, args.rounds)
    )
    return 0


def cmd_bench_spec(args) -> int:
    from server.bench.offline import print_json
    from server.bench.spec import bench_spec
    from server.engine.config import SpeculativeConfig

    spec = speculative_config(args.speculative_config)
    spec = spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig()
    engine = build_engine(args, speculative=None)
    print_json(bench_spec(engine, spec, args.workloads, args.concurrency, args.rounds, args.max_tokens))
    return 0


def cmd_bench_model(args) -> int:
    from server.bench.offline import bench_model, print_json

    dtypes = args.dtypes or ([args.dtype] if args.dtype != "auto" else ["float32", "bfloat16"])
    for dtype in dtypes:
        args.dtype = dtype
        # the step benchmarks time or compare plain decode steps: no drafts, whatever --speculative-config says
        engine = build_engine(args, max_num_seqs=1, speculative=None)
        print_json(bench_model(engine, args.prompt_len, args.output_len, args.runs))
        del engine
    return 0


def cmd_bench_profile(args) -> int:
    from server.bench.offline import bench_profile, print_json

    engine = build_engine(args, max_num_seqs=max(args.batch_sizes), speculative=None)
    for b in args.batch_sizes:
        print_json(bench_profile(engine, b, args.context_len, args.steps, args.reps))
    return 0


def cmd_bench_gemms(args) -> int:
    from server.bench.offline import bench_gemms, print_json

    engine = build_engine(args, max_num_seqs=1, speculative=None)
    for rows in args.rows:
        print_json(bench_gemms(engine, rows, args.reps))
    return 0


def cmd_bench_quality(args) -> int:
    from server.bench.offline import DEFAULT_QUALITY_TEXT, bench_quality, print_json

    text = Path(args.text or DEFAULT_QUALITY_TEXT).read_text(encoding="utf-8")
    test = build_engine(args, max_num_seqs=1, speculative=None)
    # the same weights, dequantized, in float32
    reference = build_engine(
        args, max_num_seqs=1, dtype="float32", quantization="none", batch_invariant=False, speculative=None
    )
    config = test.config
    result = bench_quality(test, reference, text, args.window)
    print_json({"quantization": config.quantization, "dtype": str(test.runner.dtype).removeprefix("torch."),
                "text": args.text or "default", **result})  # fmt: skip
    return 0


def cmd_bench_invariance(args) -> int:
    def cost(r):
        inv, not_inv = r["invariant_tokens_per_s"], r["not_invariant_tokens_per_s"]
        return {"cost_percent": round(100 * (1 - inv / not_inv), 1)}

    settings = {"invariant": {"batch_invariant": True}, "not_invariant": {"batch_invariant": False}}
    return bench_interleaved(args, settings, cost)


def cmd_bench_kernels(args) -> int:
    def speedup(r):
        return {"speedup": round(r["cpp_tokens_per_s"] / r["torch_tokens_per_s"], 2)}

    return bench_interleaved(args, {"cpp": {"cpu_kernels": "on"}, "torch": {"cpu_kernels": "off"}}, speedup)


def bench_interleaved(args, settings: dict[str, dict], summary) -> int:
    """One engine per named setting, their decode steps interleaved; a JSON line per batch size."""
    from server.bench.offline import bench_steps, print_json

    kv = {"max_num_seqs": max(args.batch_sizes), "speculative": None}
    engines = {name: build_engine(args, **s, **kv) for name, s in settings.items()}
    dtype = str(next(iter(engines.values())).runner.dtype).removeprefix("torch.")
    for b in args.batch_sizes:
        result = bench_steps(engines, b, args.input_len, args.steps)
        print_json({"dtype": dtype, **result, **summary(result)})
    return 0
