"""kvserve's command line. Each command is a function (server/commands.py) and a list of flag groups;
`commands()` is the table.

Flags marked env=True also read an environment variable KVSERVE_<FLAG> (dashes as underscores); the flag wins.
"""

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from server.api.config import REASONING_ALIASES, REASONING_PARSERS, ServerConfig
from server.commands import (
    cmd_bench,
    cmd_bench_gemms,
    cmd_bench_invariance,
    cmd_bench_kernels,
    cmd_bench_model,
    cmd_bench_offline,
    cmd_bench_profile,
    cmd_bench_quality,
    cmd_bench_spec,
    cmd_bench_structured,
    cmd_chat,
    cmd_convert_gguf,
    cmd_fetch,
    cmd_generate,
    cmd_openapi,
    cmd_serve,
    cmd_soak,
)
from server.engine.config import EngineConfig


@dataclass(frozen=True)
class Flag:
    name: str  # "--max-num-seqs", or a positional "src"
    default: object = None
    type: Callable | None = None  # int, float; None = str (or bool for switches)
    help: str | None = None
    choices: tuple | None = None
    switch: bool = False  # --flag / --no-flag
    store_true: bool = False  # --flag alone
    nargs: str | None = None
    required: bool = False
    env: bool = False  # also read KVSERVE_<FLAG>
    aliases: tuple[str, ...] = ()  # other spellings ("-tp")

    def add_to(self, parser) -> None:
        if not self.name.startswith("-"):
            parser.add_argument(self.name, help=self.help, nargs=self.nargs, default=self.default)
            return
        default = self.default
        if self.env:
            default = env(
                self.name.removeprefix("--"), default, bool if self.switch or self.store_true else self.type
            )
        kwargs: dict = {"default": default, "help": self.help}
        if self.switch:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif self.store_true:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=self.type, choices=self.choices, nargs=self.nargs, required=self.required)
        parser.add_argument(self.name, *self.aliases, **kwargs)


def env(name: str, default=None, kind=None):
    value = os.environ.get("KVSERVE_" + name.upper().replace("-", "_"))
    if value is None:
        return default
    if kind is bool:
        return value.lower() in ("1", "true", "yes", "on")
    return (kind or str)(value)


def log_level(default: str, from_env: bool = False) -> Flag:
    return Flag("--log-level", default, choices=("debug", "info", "warning", "error"), env=from_env)


ENGINE, SERVER = EngineConfig(), ServerConfig()  # the flags' defaults are the configs'
MODEL_FLAGS = (
    Flag("--model", help="HF-layout model folder (default: the embedded SmolLM2)", env=True),
    Flag("--weights-dir", help="where fetched weights live", env=True),
    Flag("--device", ENGINE.device, choices=("auto", "cpu", "cuda"), env=True),
    Flag("--dtype", ENGINE.dtype, choices=("auto", "float32", "bfloat16", "float16"), env=True),
    Flag(
        "--kv-cache-dtype",
        ENGINE.kv_cache_dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        env=True,
        help="auto: bfloat16 on CPU (the model's dtype on GPUs); else the model's dtype, or bfloat16 under float32",
    ),
    Flag("--max-num-seqs", ENGINE.max_num_seqs, int, env=True),
    Flag("--max-num-batched-tokens", ENGINE.max_num_batched_tokens, int, env=True),
    Flag("--kv-cache-memory", help="KV cache size, e.g. 2GiB", env=True),
    Flag("--gpu-memory-utilization", ENGINE.gpu_memory_utilization, float, env=True),
    Flag(
        "--enforce-eager",
        ENGINE.enforce_eager,
        switch=True,
        env=True,
        help="on a GPU: run decode steps op by op, without CUDA graphs",
    ),
    Flag(
        "--async-scheduling",
        switch=True,
        env=True,
        help="schedule and launch each step before reading the previous one back (default: on a GPU only, and "
        "never with speculative decoding)",
    ),
    Flag("--block-size", ENGINE.block_size, int, env=True),
    Flag("--enable-prefix-caching", ENGINE.enable_prefix_caching, switch=True, env=True),
    Flag(
        "--batch-invariant",
        switch=True,
        env=True,
        help="a request's numbers never depend on its batch (default: on in 16-bit dtypes on CPU, off in float32)",
    ),
    Flag("--max-model-len", None, int, env=True),
    Flag(
        "--quantization",
        ENGINE.quantization,
        choices=("auto", "none", "int8", "int4"),
        env=True,
        help="auto: serve a GGUF's quantized weights as they are (CPU); none: dequantized; int8, int4: also "
        "quantize dense weights at load",
    ),
    Flag(
        "--cpu-kernels",
        ENGINE.cpu_kernels,
        choices=("auto", "on", "off"),
        env=True,
        help="kvserve's C++ kernels on CPU: on, off (PyTorch ops), auto (on unless their build failed at install)",
    ),
    Flag(
        "--cpu-tier",
        ENGINE.cpu_tier,
        choices=("auto", "amx", "avx512bf16", "avx512", "avx2", "generic"),
        env=True,
        help="the instructions and numbers to run with on CPU (auto: the best this CPU has; see the README)",
    ),
    Flag(
        "--gemm-activations",
        ENGINE.gemm_activations,
        choices=("auto", "int8", "wide"),
        env=True,
        help="the quantized GEMMs' activations on CPU: auto, rounded to int8 per 32 as llama.cpp does where the "
        "tier has the kernel (AVX512-VNNI with BF16, AVX2), else the tier's own; int8, the same, warning where it "
        "cannot; wide, the tier's own (bfloat16 with AVX512-BF16, int16 per 32 with AVX2): closer to float32, "
        "~0.7x the GEMMs' rate at many rows (README, CPU tiers)",
    ),
    Flag(
        "--prefill-gemms",
        ENGINE.prefill_gemms,
        choices=("auto", "exact"),
        env=True,
        help="a prompt's GEMMs and attention on CPU: auto, on the amx tier the quantized weights dequantized to "
        "bfloat16 a step at a time on AMX's tiles (~2x the exact kernels' rate at hundreds of tokens), its attention "
        "on bfloat16 tiles too; generated tokens keep the exact kernels, so a token's output still never depends on "
        "its batch; exact, the kernels decoding runs",
    ),
    Flag(
        "--speculative-config",
        "auto",
        env=True,
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; off; auto (the default: n-gram drafts where the '
        "run's steps are batch-invariant, as on CPU, so the output is the same either way)",
    ),
    Flag("--chat-template", help="a Jinja chat template, or a file", env=True),
    Flag(
        "--task",
        ENGINE.task,
        choices=("auto", "generate", "embed", "score", "rerank"),
        env=True,
        help="what the model serves besides generation, as vLLM's --task names it: embed (/v1/embeddings), score "
        "or rerank (/v1/rerank, /v1/score: a Qwen3-Reranker-style yes/no model); auto: embed for a "
        "sentence-transformers folder (or a GGUF with a pooling_type), score for a Qwen3 named a reranker, else "
        "generate",
    ),
    Flag(
        "--pooling",
        choices=("last", "mean", "cls"),
        env=True,
        help="an embedder's pooling of the final hidden states (implies --task embed; default: the model's "
        "1_Pooling/config.json, else the last token's)",
    ),
    log_level("info", from_env=True),
)
SERVER_FLAGS = (
    Flag("--host", "127.0.0.1", env=True),
    Flag("--port", 8000, int, env=True),
    Flag(
        "--served-model-name",
        nargs="+",
        env=True,
        help="the model's name in /v1/models and replies (default: its file or folder name); with several, a "
        "request may give any of them, as vLLM's",
    ),
    Flag("--system-prompt", help="used when a chat request has none", env=True),
    Flag("--api-key", help="require Authorization: Bearer <key>", env=True),
    Flag("--allowed-origins", help="comma-separated CORS origins", env=True),
    Flag("--max-queue", SERVER.max_queue, int, env=True),
    Flag("--max-request-bytes", SERVER.max_request_bytes, int, env=True),
    Flag(
        "--responses-store-memory",
        "256MiB",
        env=True,
        help="memory for the Responses API's stored responses (previous_response_id, GET /v1/responses/{id}), "
        "least recently used dropped first; 0: none kept",
    ),
    Flag("--shutdown-timeout", SERVER.shutdown_timeout, float, env=True),
    Flag(
        "--read-timeout",
        SERVER.read_timeout,
        float,
        env=True,
        help="seconds a request's headers, then its body, may take to arrive; slower ones get 408",
    ),
    Flag("--no-ui", False, store_true=True, env=True, help="no chat page at /"),
    Flag(
        "--reasoning-parser",
        SERVER.reasoning_parser,
        choices=(*REASONING_PARSERS, *REASONING_ALIASES),
        env=True,
        help="how replies split into reasoning and answer: think (<think>...</think>: Qwen3, DeepSeek-R1, "
        "SmolLM3), harmony (GPT-OSS's channels), none (reasoning stays in the answer); auto: from the chat "
        "template. vLLM's names deepseek_r1, qwen3 and gpt_oss are taken too",
    ),
)
CLIENT_FLAGS = (  # kvserve chat and kvserve bench, against any OpenAI-compatible server
    Flag("--url", "http://127.0.0.1:8000", env=True),
    Flag("--model", help="model name (default: the server's first)"),
    Flag("--api-key", env=True),
    log_level("warning"),
)
GENERATE_FLAGS = (
    Flag("--prompt", required=True),
    Flag("--system", help="system message (chat models)"),
    Flag("--raw", store_true=True, help="send the prompt as is, without the chat template"),
    Flag("--max-tokens", 256, int),
    Flag("--temperature", 0.0, float, help="0 = greedy (deterministic)"),
    Flag("--top-k", 0, int),
    Flag("--top-p", 1.0, float),
    Flag("--seed", None, int),
)
CHAT_FLAGS = (
    Flag("--system"),
    Flag("--max-tokens", 512, int),
    Flag("--temperature", 0.7, float),
)
BENCH_HTTP_FLAGS = (
    Flag(
        "--workload",
        "random",
        choices=("random", "edit", "quote", "chat", "json", "turns"),
        help="random: prompts of random words, --output-len tokens each; edit, quote, chat, json: chat requests "
        "that copy much of their prompt (edit, quote), nothing (chat) or follow a JSON schema, greedy, each to its "
        "end (at most --output-len); turns: conversations of --num-turns chat requests, a first message of "
        "--input-len words, then --turn-len words a turn, each request sending the whole history (TTFT by turn)",
    ),
    Flag("--num-turns", 2, int, help="turns a conversation has (--workload turns)"),
    Flag("--turn-len", 16, int, help="words of each message after a conversation's first (--workload turns)"),
    Flag("--concurrency", 8, int),
    Flag("--num-requests", None, int, help="requests to send (default: 64, or no limit with --duration)"),
    Flag("--duration", None, float, help="send requests for this many seconds"),
    Flag("--input-len", 128, int, help="prompt length, in words (about tokens)"),
    Flag(
        "--shared-prefix-len",
        0,
        int,
        help="words every prompt starts with, the same for all (a shared system prompt), before --input-len",
    ),
    Flag("--num-shared-prefixes", 1, int, help="distinct shared prefixes, drawn at random"),
    Flag("--output-len", 128, int),
    Flag("--seed", 0, int),
)
SOAK_FLAGS = (
    Flag("--duration", 1200.0, float, help="seconds of load"),
    Flag("--concurrency", 64, int, help="requests in flight"),
    Flag("--disconnect-fraction", 0.2, float, help="share of streams the client closes after a few events"),
    Flag("--pid", None, int, help="the server's process id, to follow its resident memory (/proc)"),
    Flag("--rss-interval", 10.0, float, help="seconds between memory readings"),
    Flag("--max-tokens", 64, int),
    Flag("--request-timeout", 300.0, float),
    Flag("--record", help="write every inter-token latency and memory reading, timed, to this JSON file"),
    Flag("--seed", 0, int),
)
BENCH_OFFLINE_FLAGS = (
    Flag("--num-requests", 64, int),
    Flag("--input-len", 128, int),
    Flag("--output-len", 128, int),
    Flag("--baseline-requests", None, int, help="requests in the baseline run (default all)"),
)
BENCH_STRUCTURED_FLAGS = (
    Flag("--num-requests", 64, int),
    Flag("--input-len", 128, int),
    Flag("--output-len", 128, int),
    Flag("--rounds", 3, int, help="free and constrained runs, alternated"),
    Flag("--schema", help="a JSON schema file (default: records that never end before --output-len)"),
)
BENCH_SPEC_FLAGS = (
    Flag("--concurrency", [1, 32], int, nargs="+", help="requests at once (1: one after another)"),
    Flag("--rounds", 3, int, help="on and off runs, alternated, after one warm-up round"),
    Flag("--max-tokens", 256, int),
    Flag(
        "--workloads",
        ["edit", "quote", "chat", "chat-sampled", "json"],
        nargs="+",
        choices=("edit", "quote", "chat", "chat-sampled", "json"),
        help="chat-sampled: the chat prompts drawn at temperature 1 (little to copy, most drafts rejected)",
    ),
)
BENCH_STEPS_FLAGS = (  # bench-invariance and bench-kernels: two engines' decode steps interleaved
    Flag("--batch-sizes", [1, 32], int, nargs="+"),
    Flag("--input-len", 128, int),
    Flag("--steps", 100, int, help="decode steps measured per engine and batch size"),
)
BENCH_PROFILE_FLAGS = (
    Flag("--batch-sizes", [1, 32], int, nargs="+"),
    Flag("--context-len", 200, int, help="tokens each sequence holds when its decode steps are timed"),
    Flag("--steps", 200, int, help="engine steps timed per batch size"),
    Flag("--reps", 20, int, help="replays of the step's parts per batch size"),
)
BENCH_GEMMS_FLAGS = (
    Flag(
        "--rows", [1, 16, 32, 128, 512], int, nargs="+", help="rows of x: a decode batch or a prefill chunk"
    ),
    Flag("--reps", 20, int, help="timed calls of each GEMM per row count"),
)
BENCH_QUALITY_FLAGS = (
    Flag("--text", help="a UTF-8 text file (default: ~3,000 tokens shipped with kvserve)"),
    Flag("--window", 512, int, help="tokens per sequence the text is cut into"),
)
BENCH_MODEL_FLAGS = (
    Flag("--dtypes", nargs="+", help="dtypes to measure in turn (default: --dtype, or float32 and bfloat16)"),
    Flag("--prompt-len", 128, int),
    Flag("--output-len", 128, int),
    Flag("--runs", 3, int),
)


@dataclass(frozen=True)
class Command:
    run: Callable[[argparse.Namespace], int]
    help: str
    groups: tuple[tuple[str, tuple[Flag, ...]], ...]  # (group title, flags)


# What `vllm serve` command lines pass, so that one runs here as it is (server/commands.py, vllm_flags)
VLLM_FLAGS = (
    Flag("model_tag", nargs="?", help="the model, as `vllm serve MODEL` takes it: the same as --model"),
    Flag("--seed", None, int, env=True, help="where unseeded requests' seeds come from (default: entropy)"),
    Flag("--download-dir", env=True, help="the same as --weights-dir"),
    Flag("--root-path", "", env=True, help="the path prefix a proxy serves the API under (ASGI root_path)"),
    Flag("--uvicorn-log-level", choices=("debug", "info", "warning", "error", "critical", "trace"), env=True),
    Flag("--disable-log-stats", store_true=True, env=True, help="no periodic throughput line"),
    Flag("--disable-log-requests", store_true=True, env=True, help="no line per finished request"),
    Flag("--enable-log-requests", store_true=True, help="a line per finished request (kvserve's default)"),
    Flag(
        "--enable-auto-tool-choice",
        store_true=True,
        help="always on: calls are parsed under tool_choice auto",
    ),
    Flag(
        "--tool-call-parser",
        env=True,
        help="taken where kvserve reads that convention, whichever the model writes: hermes (<tool_call> JSON), "
        "openai (GPT-OSS's harmony), gemma4; others are refused",
    ),
    Flag("--trust-remote-code", store_true=True, help="taken: kvserve never runs a checkpoint's code"),
    Flag("--enable-chunked-prefill", switch=True, help="always on: prompts are chunked"),
    Flag("--tensor-parallel-size", 1, int, aliases=("-tp",), help="1: one GPU or the CPU"),
    Flag("--pipeline-parallel-size", 1, int, aliases=("-pp",), help="1"),
    Flag("--data-parallel-size", 1, int, aliases=("-dp",), help="1"),
)


def commands() -> dict[str, Command]:
    """The command table (built when called, so that the functions are looked up then)."""
    model = ("model and engine", MODEL_FLAGS)
    return {
        "serve": Command(
            cmd_serve,
            "serve the model over an OpenAI-compatible HTTP API",
            (model, ("server", SERVER_FLAGS), ("vLLM's flags, taken as `vllm serve` has them", VLLM_FLAGS)),
        ),
        "openapi": Command(
            cmd_openapi,
            "print the OpenAPI document of the served API (openapi.yaml)",
            (("", (log_level("warning"),)),),
        ),
        "chat": Command(
            cmd_chat, "interactive terminal chat against a running server", (("", CLIENT_FLAGS + CHAT_FLAGS),)
        ),
        "bench": Command(
            cmd_bench,
            "serving benchmark against an OpenAI-compatible server",
            (("", CLIENT_FLAGS + BENCH_HTTP_FLAGS),),
        ),
        "soak": Command(
            cmd_soak,
            "hold a kvserve on this machine under mixed load and report what drifts (5xx, memory, latency, KV)",
            (("", CLIENT_FLAGS + SOAK_FLAGS),),
        ),
        "generate": Command(
            cmd_generate,
            "generate an answer in the terminal, streaming",
            (model, ("generation", GENERATE_FLAGS)),
        ),
        "fetch": Command(
            cmd_fetch,
            "download the embedded default model's GGUF, which serve reads in place (idempotent)",
            (("", (Flag("--weights-dir", env=True), log_level("info", from_env=True))),),
        ),
        "convert-gguf": Command(
            cmd_convert_gguf,
            "convert a llama-family GGUF file into a Hugging Face folder",
            (("", (Flag("src"), Flag("dst"), log_level("info", from_env=True))),),
        ),
        "bench-offline": Command(
            cmd_bench_offline,
            "engine throughput at a concurrency, against max-num-seqs 1",
            (model, ("benchmark", BENCH_OFFLINE_FLAGS)),
        ),
        "bench-structured": Command(
            cmd_bench_structured,
            "throughput with every request constrained by a JSON schema, against free, alternated",
            (model, ("benchmark", BENCH_STRUCTURED_FLAGS)),
        ),
        "bench-spec": Command(
            cmd_bench_spec,
            "speculative decoding on against off (--speculative-config, or n-gram defaults), alternated, on "
            "copy-heavy and open workloads",
            (model, ("benchmark", BENCH_SPEC_FLAGS)),
        ),
        "bench-invariance": Command(
            cmd_bench_invariance,
            "decode tokens/s with and without batch invariance, interleaved",
            (model, ("benchmark", BENCH_STEPS_FLAGS)),
        ),
        "bench-kernels": Command(
            cmd_bench_kernels,
            "decode tokens/s with the C++ CPU kernels and with PyTorch ops, interleaved",
            (model, ("benchmark", BENCH_STEPS_FLAGS)),
        ),
        "bench-profile": Command(
            cmd_bench_profile,
            "where a decode step's time goes: the step, and its parts replayed on the model's own weights",
            (model, ("benchmark", BENCH_PROFILE_FLAGS)),
        ),
        "bench-gemms": Command(
            cmd_bench_gemms,
            "the model's GEMMs at given row counts, against oneDNN's bfloat16 GEMM on the same weights",
            (model, ("benchmark", BENCH_GEMMS_FLAGS)),
        ),
        "bench-quality": Command(
            cmd_bench_quality,
            "mean KL divergence and top-1 agreement of the model (e.g. quantized) against float32",
            (model, ("benchmark", BENCH_QUALITY_FLAGS)),
        ),
        "bench-model": Command(
            cmd_bench_model,
            "prefill and single-stream decode tokens/s per dtype",
            (model, ("benchmark", BENCH_MODEL_FLAGS)),
        ),
    }


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="kvserve",
        description="An OpenAI-compatible inference server. The model and server flags also read an environment "
        "variable KVSERVE_<FLAG> (dashes as underscores); the flag wins.",
    )
    sub = top.add_subparsers(dest="command", required=True)
    for name, command in commands().items():
        p = sub.add_parser(name, help=command.help)
        for title, flags in command.groups:
            group = p.add_argument_group(title) if title else p
            for flag in flags:
                flag.add_to(group)
        p.set_defaults(func=command.run)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
