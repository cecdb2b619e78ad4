"""ModelRunner: a SchedulerOutput in, sampled tokens out. Owns the model, the KV cache and the device."""

import logging
import os
from dataclasses import dataclass

import torch

from model.attention import build_metadata, min_query_len_for_invariance
from model.config import ModelConfig
from model.kernels import cpu_kernels
from model.kv_cache import KVCache
from model.loader import load_model
from model.sampling import SamplingTensors, sample
from model.transformer import calibrate_batch_invariance, pack_weights
from server.engine.config import EngineConfig
from server.engine.request import Request, TokenLogprob
from server.engine.scheduler import SchedulerOutput, is_sampled

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# default cache on CPU: 2 GiB, zeroed (so resident) at start: a machine short of memory fails then, not under load
CPU_KV_CACHE_BYTES = 2 << 30


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but no CUDA GPU is available to torch")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu or cuda")
    return torch.device(name)


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # bfloat16 halves the bytes read per token and its CPU GEMM rows are batch-invariant; without native
    # bf16 instructions it is emulated and slower than float32.
    return (
        torch.bfloat16
        if torch.backends.cpu.get_cpu_capability() == "AVX512" and _has_bf16()
        else torch.float32
    )


def _has_bf16() -> bool:
    try:
        return "avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


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


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None


def bound_onednn_caches(capacity: int = 256) -> None:
    """Cap the kernels oneDNN keeps per GEMM shape (read once, at its first use, from the environment).

    Both of its caches (ideep's and the library's) default to 1,024 entries, and each entry holds memory
    (~0.25 MiB for small shapes): a server's RSS grew by 230 MiB over 800 mixed requests, by 50 MiB with
    both at 256. Steady decoding uses a few dozen shapes (GEMM rows are bucketed), so nothing is rebuilt.
    A value already in the environment wins.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(capacity))


class ModelRunner:
    def __init__(self, model_path: str, config: EngineConfig):
        self.config = config
        bound_onednn_caches()
        self.device = select_device(config.device)
        self.dtype = select_dtype(config.dtype, self.device)
        log.info("loading %s on %s in %s", model_path, self.device, str(self.dtype).removeprefix("torch."))
        self.model, self.model_config = load_model(model_path, self.dtype, self.device)
        mc: ModelConfig = self.model_config
        self.block_size = config.block_size
        self.num_blocks = self._num_cache_blocks()
        self.kv_cache = KVCache(mc, self.num_blocks, self.block_size, self.dtype, self.device)
        self.max_model_len = self._max_model_len()
        if self.device.type == "cpu" and pack_weights(self.model):
            log.info("GEMM weights packed for oneDNN")
        # A request's tokens must not depend on its batch. CPU GEMMs may switch kernels (summation orders)
        # for small row counts: the GEMMs that do pad small batches (measured per weight shape at start),
        # and attention matmuls get enough query rows. By default for 16-bit dtypes (the CPU default),
        # where it is nearly free, not for float32, where more GEMMs pad.
        invariant = config.batch_invariant
        if invariant is None:
            invariant = self.dtype != torch.float32
        invariant = invariant and self.device.type == "cpu"
        self.cpu_kernels = self._use_cpu_kernels(config.cpu_kernels)
        self.min_query_len = 1
        if invariant:
            padded = calibrate_batch_invariance(self.model)
            if not self.cpu_kernels:  # the C++ attention kernel is batch-invariant as it is
                self.min_query_len = min_query_len_for_invariance(
                    mc.num_heads, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
                )
            log.info(
                "batch invariance: %d GEMMs pad small batches; attention pads queries to %d",
                padded,
                self.min_query_len,
            )
        self.prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}

    def _use_cpu_kernels(self, mode: str) -> bool:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"unknown --cpu-kernels {mode!r}: use auto, on or off")
        if self.device.type != "cpu" or mode == "off":
            return False
        kernels = cpu_kernels()
        if kernels is None:
            if mode == "on":
                raise RuntimeError("--cpu-kernels on: the C++ kernels could not be built (see the log)")
            return False
        self.model.use_cpu_kernels(kernels)
        log.info("attention and RMSNorm: kvserve's C++ CPU kernels")
        return True

    def _num_cache_blocks(self) -> int:
        mc, c = self.model_config, self.config
        per_block = KVCache.bytes_per_block(mc, self.block_size, self.dtype)
        if c.kv_cache_memory is not None:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free
            budget = (
                int(total * c.gpu_memory_utilization) - used_elsewhere - (1 << 30)
            )  # 1 GiB for activations
        else:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes")
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            self.block_size,
            num_blocks * per_block / 2**30,
        )
        return num_blocks

    def _max_model_len(self) -> int:
        model_len = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None:
            if self.config.max_model_len > model_len:
                log.warning(
                    "--max-model-len %d is beyond the model's context %d",
                    self.config.max_model_len,
                    model_len,
                )
            model_len = self.config.max_model_len
        capacity = self.num_blocks * self.block_size
        if capacity < model_len:
            log.warning("context capped to %d tokens: the KV cache holds no more for one sequence", capacity)
            model_len = capacity
        return model_len

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, Sampled]:
        ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []  # flat index of the last token of each sampled request
        sampled_reqs: list[Request] = []
        echo: list[tuple[Request, int, int, int]] = []  # (request, first flat index, first position, n)
        for req, n in out.scheduled:
            c = req.num_computed_tokens
            ids.extend(_token_slice(req, c, c + n))
            if req.params.prompt_logprobs and c < req.num_prompt_tokens:
                echo.append((req, len(ids) - n, c, n))
            query_lens.append(n)
            seq_lens.append(c + n)
            tables.append(req.block_table)
            if is_sampled(req, n):
                sample_rows.append(len(ids) - 1)
                sampled_reqs.append(req)
        positions, meta = build_metadata(
            query_lens, seq_lens, tables, self.block_size, self.device,
            self.model_config.sliding_window, self.min_query_len, self.cpu_kernels,
        )  # fmt: skip
        input_ids = torch.tensor(ids, dtype=torch.long)
        hidden = self.model(input_ids.to(self.device, non_blocking=True), positions, meta, self.kv_cache)
        if echo:
            self._collect_prompt_logprobs(hidden, echo)
        if not sampled_reqs:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        result = sample(logits, self._sampling_tensors(sampled_reqs))
        token_ids = result.token_ids.tolist()  # the one host read per step
        logprobs = [None] * len(token_ids)
        if result.top_ids is not None:
            chosen = result.logprobs.tolist()
            top_ids, top_lps = result.top_ids.tolist(), result.top_logprobs.tolist()
            logprobs = [
                TokenLogprob(t, lp, list(zip(ti[: r.params.logprobs], tl[: r.params.logprobs], strict=True)))
                if r.params.logprobs is not None
                else None
                for r, t, lp, ti, tl in zip(sampled_reqs, token_ids, chosen, top_ids, top_lps, strict=True)
            ]
        return {
            r.request_id: Sampled(t, lp) for r, t, lp in zip(sampled_reqs, token_ids, logprobs, strict=True)
        }

    def _sampling_tensors(self, reqs: list[Request]) -> SamplingTensors:
        return SamplingTensors.from_lists(
            temperature=[r.params.temperature for r in reqs],
            top_k=[max(r.params.top_k, 0) for r in reqs],
            top_p=[r.params.top_p for r in reqs],
            min_p=[r.params.min_p for r in reqs],
            repetition_penalty=[r.params.repetition_penalty for r in reqs],
            presence_penalty=[r.params.presence_penalty for r in reqs],
            frequency_penalty=[r.params.frequency_penalty for r in reqs],
            seeds=[r.params.seed for r in reqs],  # the engine gives unseeded requests a random seed
            positions=[len(r.output_token_ids) for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            suppress_ids=[_suppressed(r) for r in reqs],
            logit_bias=[r.params.logit_bias for r in reqs],
            max_num_logprobs=max(
                (r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None
            ),
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )

    def _collect_prompt_logprobs(self, hidden: torch.Tensor, echo) -> None:
        for req, start, pos, n in echo:
            lps = self.prompt_logprobs.setdefault(req.request_id, [None])
            # logits at prompt position p score the prompt token at p + 1
            last = min(n, req.num_prompt_tokens - 1 - pos)
            if last <= 0:
                continue
            logits = self.model.compute_logits(hidden[start : start + last])
            logp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(req.prompt_token_ids[pos + 1 : pos + 1 + last], device=logp.device)
            chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            k = req.params.logprobs or 0
            top_lp, top_id = logp.topk(max(k, 1), dim=-1)
            for t, lp, ti, tl in zip(targets.tolist(), chosen, top_id.tolist(), top_lp.tolist(), strict=True):
                lps.append(TokenLogprob(t, lp, list(zip(ti[:k], tl[:k], strict=True))))

    def take_prompt_logprobs(self, request_id: str) -> list[TokenLogprob | None] | None:
        return self.prompt_logprobs.pop(request_id, None)


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_token_ids[start:end] without building the whole list every step."""
    p = req.num_prompt_tokens
    if end <= p:
        return req.prompt_token_ids[start:end]
    if start >= p:
        return req.output_token_ids[start - p : end - p]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - p]


def _suppressed(req: Request) -> list[int]:
    """Stop tokens are banned until min_tokens outputs exist."""
    if len(req.output_token_ids) >= req.params.min_tokens:
        return []
    ids = set(req.params.stop_token_ids)
    if not req.params.ignore_eos:
        ids |= req.eos_token_ids
    return sorted(ids)
