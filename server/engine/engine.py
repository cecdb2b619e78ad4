"""Engine: the synchronous core. add_request / abort / step(); one step flows one way:

scheduler.schedule() -> runner.launch() -> runner.collect() -> outputs.process() -> scheduler.update()
which tokens run       queued on the      its draws read      deltas, and who      append the tokens,
(counted computed)     device             back                finished and why     free the finished

Async scheduling (on a GPU by default): step() schedules and launches step N + 1 before it reads back step N,
so the host's work between two steps (reading back, detokenizing, scheduling, building the next inputs) runs
while the device computes, instead of the device waiting for it. N + 1's decodes take the tokens N drew on the
device; a request N finished is computed once more in N + 1, for nothing. Where a draw depends on which tokens
came before (penalties, a grammar, reasoning), N is read back before N + 1 is scheduled.
"""

import dataclasses
import logging
import random
import time

import torch

from model.kv_cache import KVCache
from model.tokenizer import Tokenizer
from server.engine.config import EngineConfig, SpeculativeConfig
from server.engine.drafting import Drafter, StepCosts
from server.engine.grammar import GrammarCompiler
from server.engine.model_runner import LaunchedStep
from server.engine.output_processor import OutputProcessor
from server.engine.pooling import select_task
from server.engine.reasoning import ReasoningState
from server.engine.request import (
    CONTEXT_LENGTH_EXCEEDED,
    ParamError,
    PoolingParams,
    RequestOutput,
    SamplingParams,
)
from server.engine.request_state import Request
from server.engine.scheduler import Scheduler
from server.engine.setup import build_runner, context_length, select_speculation
from server.engine.stats import EngineStats

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, config: EngineConfig, chat_template: str | None = None):
        """`model`: a Hugging Face folder's path, or a source its caller opened (a GGUF file read in place:
        model/loader.py says what a source holds)."""
        self.config = config
        self.task = select_task(model, config.task, config.pooling)  # before loading: a bad one fails at once
        self.runner = build_runner(model, config)
        self.model_config = self.runner.model_config
        if self.model_config.linear_layers:
            self.config = config = hybrid_config(config, self.runner.kv_cache)
        self.tokenizer = Tokenizer.load(model, chat_template)
        self.max_model_len = context_length(self.model_config, config, self.runner.num_blocks)
        self.kv_cache_dtype = str(self.runner.kv_cache.k.dtype).removeprefix("torch.")
        self.scheduler = self._scheduler()
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        # stop tokens: the union of config.json, generation_config.json and the tokenizer's EOS
        self.seeds = random.Random(config.seed)  # for requests that bring none
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids
        )
        self.vocab_size = self.model_config.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.step_costs = StepCosts()  # what this host's steps cost by decodes and drafts: kept across resets
        self.drafter = self._drafter()
        self.async_scheduling = self._async_scheduling()
        # under async scheduling, the step launched and not read back yet
        self.in_flight: LaunchedStep | None = None
        log.info("task: %s (%s)", self.task.task, self.task.why)
        log.info("async scheduling: %s", "on" if self.async_scheduling else "off")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Raise ParamError (shown to the client, naming the parameter) when the request can never be served.
        Reads only what is fixed at start, so any thread may call it. PoolingParams: a prefill-only request."""
        params.validate(self.vocab_size)
        if isinstance(params, SamplingParams) and not self.model_config.has_lm_head:
            raise ParamError("model", "this model has no LM head (an embedder's checkpoint): it only embeds")
        if not prompt_token_ids:
            raise ParamError("prompt", "the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ParamError("prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        max_tokens = params.max_tokens if isinstance(params, SamplingParams) else 0
        error = self.scheduler.check_fits(len(prompt_token_ids), max_tokens)
        if error:
            raise ParamError("prompt", error, code=CONTEXT_LENGTH_EXCEEDED)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams
    ) -> None:
        """Validate, then queue the request, arrived now (raises ParamError as validate() does)."""
        self.validate(prompt_token_ids, params)
        self.add_validated_request(request_id, prompt_token_ids, params)

    def add_validated_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request its caller has validated (the async engine validates on the event loop).
        `arrival_time` is the time.monotonic() at which the caller received it (now if None): every latency
        the request reports (queue time, TTFT, end to end) counts from it. A PoolingParams request is
        prefill-only: its one output comes after its prompt's last chunk, with its vector."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        pooling = None
        if isinstance(params, PoolingParams):  # nothing is drawn: these sampling fields are only well-formed
            pooling, params = params, SamplingParams(max_tokens=1, seed=0)
        if params.seed is None:  # a fixed seed per request keeps its draws independent of the batch
            params = dataclasses.replace(params, seed=self.seeds.getrandbits(63))
        request = Request(
            request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids, pooling=pooling
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        grammar = params.grammar.new_state() if params.grammar is not None else None
        if params.reasoning is not None:  # the grammar waits for the reasoning's end
            request.reasoning = ReasoningState(params.reasoning, grammar)
        else:
            request.grammar = grammar
        self.outputs.add(request)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its last output, or None if it had already finished."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        output = self.outputs.abort(request)
        self.scheduler.finish_request(request, output.finish_reason)
        if self.drafter is not None:
            self.drafter.forget(request_id)
        if not self.scheduler.has_unfinished_requests():
            self.in_flight = None  # nothing of it is wanted (the device finishes it before any later step)
        return output

    def abort_all(self) -> list[RequestOutput]:
        return [o for rid in list(self.scheduler.requests) if (o := self.abort(rid)) is not None]

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, and return the outputs of the step read back: this one's, or under async
        scheduling the one before (read while this one runs)."""
        previous, self.in_flight = self.in_flight, None
        outputs: list[RequestOutput] = []
        if previous is not None and any(
            c.sample and c.request.next_draw_reads_output for c in previous.scheduled.chunks
        ):
            outputs, previous = self._finish(previous), None  # what it drew decides how the next step draws
        scheduled = self.scheduler.schedule()
        launched = self.runner.launch(scheduled, previous) if not scheduled.is_empty else None
        if previous is not None:
            outputs += self._finish(previous)
        if launched is not None and self.async_scheduling:
            self.in_flight = launched
        elif launched is not None:
            outputs += self._finish(launched)
        return outputs

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step back: its outputs, and the scheduler's requests updated by them."""
        computed = self.runner.collect(launched)
        scheduled = launched.scheduled
        outputs, finished = self.outputs.process(scheduled, computed)
        kept = {o.request_id: o.new_token_ids for o in outputs}
        if computed.draft_states:  # a hybrid's state back to its last kept token
            self.runner.roll_back_states(scheduled, computed, kept)
        self.scheduler.update(scheduled, kept, finished)
        if self.drafter is not None:
            # what this step cost: the drafter sizes the next ones by it
            seconds = time.perf_counter() - launched.started
            self.drafter.after_step(scheduled.chunks, kept, finished, self.scheduler.running, seconds)
        return outputs

    def score(self, token_ids: list[int], chunk: int = 256) -> torch.Tensor:
        """[n, vocab] float32 logits at every position of one text, for quality benchmarks; only when no
        request is left (it writes the cache's first blocks, so the prefix cache starts afresh after)."""
        if self.has_work():
            raise RuntimeError("the engine still has requests")
        logits = self.runner.score(token_ids, chunk)
        self.reset()
        return logits

    def reset(self, **changes) -> None:
        """Start afresh over the same model, cache and kernels (an empty prefix cache), with EngineConfig
        fields changed (e.g. max_num_seqs); only when no request is left. For benchmarks."""
        if self.has_work():
            raise RuntimeError("the engine still has requests")
        self.config = dataclasses.replace(self.config, **changes)
        self.scheduler = self._scheduler()
        self.drafter = self._drafter()
        self.async_scheduling = self._async_scheduling()

    def _async_scheduling(self) -> bool:
        """config.async_scheduling, where auto (None) is the backend's choice: on a GPU, whose idle time the host's
        work between steps would be, not on a CPU. Never with drafts: a step's drafts come from the tokens read
        back just before it."""
        asked = self.config.async_scheduling
        on = asked if asked is not None else self.runner.backend.async_scheduling
        if on and self.drafter is not None:
            if asked:
                log.warning("async scheduling: off (speculative decoding drafts from the tokens read back)")
            return False
        return on

    def _scheduler(self) -> Scheduler:
        cache = self.runner.kv_cache
        windows = self.model_config.kv_group_windows
        return Scheduler(
            self.config, self.runner.num_blocks, self.max_model_len, cache.num_state_slots,
            cache.num_snapshot_slots, windows, outputs_apart=self.runner.prompt_gemms,
        )  # fmt: skip

    def _drafter(self) -> Drafter | None:
        """The drafter config.speculative asks for, "auto" resolved against this runner (and kept resolved)."""
        if self.config.speculative == "auto":
            self.config = dataclasses.replace(self.config, speculative=select_speculation(self.runner))
        spec = self.config.speculative
        if spec is not None and self.model_config.linear_layers:
            spec = fit_drafts_to_states(spec, self.runner.kv_cache)
        return Drafter(spec, self.step_costs) if spec is not None else None

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats()
        stats = dataclasses.replace(
            stats,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_resident_bytes=self.runner.kv_cache.resident_bytes(stats.num_blocks_touched),
        )
        if self.drafter is not None:
            d = self.drafter
            stats = dataclasses.replace(
                stats,
                num_drafts=d.num_drafts,
                num_draft_tokens=d.num_draft_tokens,
                num_accepted_tokens=d.num_accepted_tokens,
                accepted_per_position=dict(d.accepted_per_position),
            )
        return stats


def hybrid_config(config: EngineConfig, cache: KVCache) -> EngineConfig:
    """A hybrid model (Gated DeltaNet layers: model/deltanet.py) runs as many sequences as its cache has state
    slots and caches prefixes only where it keeps state snapshots. Each said in the log where it changes what was
    asked for."""
    if cache.num_state_slots < config.max_num_seqs:
        log.warning("max_num_seqs: %d (the DeltaNet states the cache holds)", cache.num_state_slots)
    if config.enable_prefix_caching and not cache.num_snapshot_slots:
        log.warning("prefix caching: off (the cache holds no DeltaNet state snapshot)")
    return dataclasses.replace(
        config,
        max_num_seqs=min(config.max_num_seqs, cache.num_state_slots),
        enable_prefix_caching=config.enable_prefix_caching and cache.num_snapshot_slots > 0,
    )


def fit_drafts_to_states(spec: SpeculativeConfig, cache: KVCache) -> SpeculativeConfig | None:
    """A hybrid verifies a step's drafts keeping its state after each (to go back to the last one kept): no more
    drafts a step than the cache has slots for, none without (logged)."""
    if not cache.num_draft_slots:
        log.warning("speculative decoding: off (the cache holds no DeltaNet state for drafts)")
        return None
    if cache.num_draft_slots + 1 < spec.max_step_rows:
        log.warning("speculative decoding: %d drafts a step at most (the DeltaNet states the cache holds)",
                    cache.num_draft_slots)  # fmt: skip
        spec = dataclasses.replace(spec, max_step_rows=cache.num_draft_slots + 1)
    return spec
