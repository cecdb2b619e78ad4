"""kvserve's command line: serve, generate, fetch, convert-gguf, openapi, bench, bench-offline, bench-model,
bench-invariance, bench-kernels, chat.

Every flag also reads an environment variable KVSERVE_<FLAG> (dashes as underscores); the flag wins.
"""

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("kvserve")
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def env(name: str, default=None, kind=str):
    value = os.environ.get("KVSERVE_" + name.upper().replace("-", "_"))
    if value is None:
        return default
    if kind is bool:
        return value.lower() in ("1", "true", "yes", "on")
    return kind(value)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model", default=env("model"), help="HF-layout model folder (default: the embedded SmolLM2)"
    )
    g.add_argument("--weights-dir", default=env("weights_dir"), help="where fetched weights live")
    g.add_argument("--device", default=env("device", "auto"), choices=["auto", "cpu", "cuda"])
    g.add_argument(
        "--dtype", default=env("dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"]
    )
    g.add_argument("--max-num-seqs", type=int, default=env("max_num_seqs", 64, int))
    g.add_argument("--max-num-batched-tokens", type=int, default=env("max_num_batched_tokens", 512, int))
    g.add_argument("--kv-cache-memory", default=env("kv_cache_memory"), help="KV cache size, e.g. 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=env("gpu_memory_utilization", 0.9, float))
    g.add_argument("--block-size", type=int, default=env("block_size", 16, int))
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=env("enable_prefix_caching", True, bool),
    )
    g.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=env("batch_invariant", None, bool),
        help="a request's numbers never depend on its batch (default: on in 16-bit dtypes on CPU, off in float32)",
    )
    g.add_argument("--max-model-len", type=int, default=env("max_model_len", None, int))
    g.add_argument("--enforce-eager", action="store_true", default=env("enforce_eager", False, bool))
    g.add_argument(
        "--cpu-kernels",
        default=env("cpu_kernels", "auto"),
        choices=["auto", "on", "off"],
        help="C++ attention and RMSNorm on CPU: on, off (PyTorch ops), auto (on where they build)",
    )
    g.add_argument("--chat-template", default=env("chat_template"), help="a Jinja chat template, or a file")
    g.add_argument(
        "--log-level", default=env("log_level", "info"), choices=["debug", "info", "warning", "error"]
    )


def resolve_model(args) -> str:
    if args.model:
        return args.model
    from weights.fetch import ensure_default_model
    from weights.store import weights_dir

    return str(ensure_default_model(weights_dir(args.weights_dir)))


def engine_config(args, **overrides):
    from server.engine.config import EngineConfig
    from server.engine.model_runner import parse_size

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        batch_invariant=args.batch_invariant,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        cpu_kernels=args.cpu_kernels,
    )
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def build_engine(args, **overrides):
    from server.engine.engine import Engine

    return Engine(resolve_model(args), engine_config(args, **overrides), args.chat_template)


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
    from weights.fetch import ensure_default_model
    from weights.store import weights_dir

    print(ensure_default_model(weights_dir(args.weights_dir)))
    return 0


def cmd_convert_gguf(args) -> int:
    from weights.gguf_convert import convert_gguf

    convert_gguf(Path(args.src), Path(args.dst))
    print(args.dst)
    return 0


def cmd_bench_offline(args) -> int:
    from server.bench import bench_offline, print_json

    engine = build_engine(args)
    print_json(
        bench_offline(engine, args.num_requests, args.input_len, args.output_len, args.baseline_requests)
    )
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
    from server.bench import bench_batch_invariance, print_json

    kv = {"max_num_seqs": max(args.batch_sizes)}
    engines = {name: build_engine(args, **s, **kv) for name, s in settings.items()}
    dtype = str(next(iter(engines.values())).runner.dtype).removeprefix("torch.")
    for b in args.batch_sizes:
        result = bench_batch_invariance(engines, b, args.input_len, args.steps)
        print_json({"dtype": dtype, **result, **summary(result)})
    return 0


def server_config(args, model_path: str | None):
    from server.api.app import ServerConfig

    name = args.served_model_name or (Path(model_path).name if model_path else DEFAULT_MODEL_NAME)
    return ServerConfig(
        served_model_name=name,
        api_key=args.api_key,
        allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()],
        max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        shutdown_timeout=args.shutdown_timeout,
        system_prompt=args.system_prompt,
    )


def cmd_serve(args) -> int:
    import threading

    import uvicorn

    from server.api.app import create_app, set_engine
    from server.api.server import DrainingServer, log_stats_periodically
    from server.engine.async_engine import AsyncEngine

    app = create_app(None, server_config(args, args.model))
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False), app
    )
    failed = threading.Event()

    def load() -> None:  # the listener is up meanwhile: /health answers 503 until the engine is set
        try:
            engine = AsyncEngine(lambda: build_engine(args))  # built on its stepping thread
        except Exception as e:
            log.error("could not load the model: %s", e, exc_info=args.log_level == "debug")
            failed.set()
            server.should_exit = True
            return
        set_engine(app, engine)
        log.info(
            "ready: serving %s at http://%s:%d/v1", app.state.config.served_model_name, args.host, args.port
        )
        log_stats_periodically(engine, server)

    threading.Thread(target=load, name="kvserve-load", daemon=True).start()
    server.run()
    if app.state.engine is not None:
        app.state.engine.shutdown()
    return 1 if failed.is_set() or not server.started else 0


def cmd_openapi(args) -> int:
    from server.api.app import ServerConfig, create_app, openapi_yaml

    sys.stdout.write(openapi_yaml(create_app(None, ServerConfig())))
    return 0


def cmd_chat(args) -> int:
    from client.chat import chat_loop

    return chat_loop(args.url, args.model, args.api_key, args.system, args.max_tokens, args.temperature)


def cmd_bench(args) -> int:
    import asyncio

    from client.bench import bench_http

    asyncio.run(bench_http(args))
    return 0


def cmd_bench_model(args) -> int:
    from server.bench import bench_model, print_json

    dtypes = args.dtypes or ([args.dtype] if args.dtype != "auto" else ["float32", "bfloat16"])
    for dtype in dtypes:
        args.dtype = dtype
        engine = build_engine(args, max_num_seqs=1)
        print_json(bench_model(engine, args.prompt_len, args.output_len, args.runs))
        del engine
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_flags(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=env("host", "127.0.0.1"))
    g.add_argument("--port", type=int, default=env("port", 8000, int))
    g.add_argument("--served-model-name", default=env("served_model_name"))
    g.add_argument("--system-prompt", default=env("system_prompt"), help="used when a chat request has none")
    g.add_argument("--api-key", default=env("api_key"), help="require Authorization: Bearer <key>")
    g.add_argument("--allowed-origins", default=env("allowed_origins"), help="comma-separated CORS origins")
    g.add_argument("--max-queue", type=int, default=env("max_queue", 256, int))
    g.add_argument("--max-request-bytes", type=int, default=env("max_request_bytes", 4 << 20, int))
    g.add_argument("--shutdown-timeout", type=float, default=env("shutdown_timeout", 30.0, float))
    g.add_argument(
        "--read-timeout",
        type=float,
        default=env("read_timeout", 30.0, float),
        help="seconds a request body may take to arrive; slower ones get 408",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("openapi", help="print the OpenAPI document of the served API (openapi.yaml)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_openapi)

    p = sub.add_parser("chat", help="interactive terminal chat against a running server")
    p.add_argument("--url", default=env("url", "http://127.0.0.1:8000"))
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=env("api_key"))
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="serving benchmark against an OpenAI-compatible server")
    p.add_argument("--url", default=env("url", "http://127.0.0.1:8000"))
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=env("api_key"))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests to send (default: 64, or no limit with --duration)",
    )
    p.add_argument("--duration", type=float, default=None, help="send requests for this many seconds")
    p.add_argument("--input-len", type=int, default=128, help="prompt length, in words (about tokens)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("generate", help="generate an answer in the terminal, streaming")
    add_model_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", default=None, help="system message (chat models)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (deterministic)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("fetch", help="download and convert the embedded default model (idempotent)")
    p.add_argument("--weights-dir", default=env("weights_dir"))
    p.add_argument("--log-level", default=env("log_level", "info"))
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("convert-gguf", help="convert a llama-family GGUF file into a Hugging Face folder")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--log-level", default=env("log_level", "info"))
    p.set_defaults(func=cmd_convert_gguf)

    p = sub.add_parser("bench-offline", help="engine throughput at a concurrency, against max-num-seqs 1")
    add_model_flags(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--baseline-requests", type=int, default=None, help="requests in the baseline run (default all)"
    )
    p.set_defaults(func=cmd_bench_offline)

    p = sub.add_parser(
        "bench-invariance", help="decode tokens/s with and without batch invariance, interleaved"
    )
    add_model_flags(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="decode steps measured per engine and batch size")
    p.set_defaults(func=cmd_bench_invariance)

    p = sub.add_parser(
        "bench-kernels",
        help="decode tokens/s with the C++ CPU kernels and with PyTorch ops, interleaved",
    )
    add_model_flags(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="decode steps measured per engine and batch size")
    p.set_defaults(func=cmd_bench_kernels)

    p = sub.add_parser("bench-model", help="prefill and single-stream decode tokens/s per dtype")
    add_model_flags(p)
    p.add_argument(
        "--dtypes", nargs="+", help="dtypes to measure in turn (default: --dtype, or float32 and bfloat16)"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.set_defaults(func=cmd_bench_model)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as e:  # bad flags, no GPU, unreadable model, no registry
        if args.log_level == "debug":
            raise
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
