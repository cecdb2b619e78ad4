"""AsyncEngine: the engine client the API talks to, and the one place with asyncio.

Its surface is all the API needs: validate, compile_grammar, generate, abort, stats, the tokenizer, the limits
(max_model_len, vocab_size, hidden_size) and the served task (generation, embeddings, scores), plus drain and
shutdown. A background thread steps the Engine while there is work; the event loop never waits on the model
(the C++ kernels let go of the GIL while they run): new requests and aborts are handed to the stepping thread
through a queue and applied between steps; a step's outputs come back in one call_soon_threadsafe per event loop,
each to its request's _Stream, which merges an output into the one before while that still waits. When idle, the
thread blocks on an Event (no polling).
"""

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from server.engine.engine import Engine
from server.engine.grammar import COMPILE_SECONDS, CompiledGrammar, is_quick
from server.engine.pooling import ServedTask
from server.engine.request import (
    FinishReason,
    GrammarSpec,
    PoolingParams,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from server.engine.stats import EngineStats

log = logging.getLogger(__name__)


class _Stream:
    """One request's outputs on their way to its consumer, touched only on the consumer's event loop. An output
    that comes while the one before still waits is merged into it, as vLLM's output collector does: a consumer
    slower than the steps (hundreds of streams on one event loop, each chunk a socket write) then takes what
    several steps made in one delta, one wakeup and one write, instead of falling further behind each step."""

    __slots__ = ("loop", "pending", "ready")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: collections.deque[RequestOutput] = collections.deque()
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.pending and mergeable(self.pending[-1], output):
            self.pending[-1] = merged(self.pending[-1], output)
        else:
            self.pending.append(output)
        self.ready.set()

    async def get(self) -> RequestOutput:
        while not self.pending:
            self.ready.clear()
            await self.ready.wait()
        return self.pending.popleft()


def mergeable(earlier: RequestOutput, later: RequestOutput) -> bool:
    """Whether two outputs of a request can go out as one delta: not past its end, nor into an error (the text
    before an error goes out before it) or a pooled vector."""
    return not earlier.finished and later.error is None and later.pooled is None


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """The delta of `earlier` then `later`: the new tokens, text, logprobs and marks of both; the rest as of
    `later`, the prompt's logprobs as of the first."""
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return dataclasses.replace(
        later,
        new_token_ids=earlier.new_token_ids + later.new_token_ids,
        text=earlier.text + later.text,
        logprobs=logprobs,
        prompt_logprobs=earlier.prompt_logprobs
        if earlier.prompt_logprobs is not None
        else later.prompt_logprobs,
        marks=earlier.marks + [(len(earlier.text) + offset, token) for offset, token in later.marks],
    )


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    arrival_time: float  # stamped on the event loop: the wait in the inbox counts as queue time


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine]):
        """Serve `engine`, or the engine a function builds: then it is built in the stepping thread, so that
        one thread does all of its tensor work. GNU OpenMP counts the workers of every thread that has run a
        parallel region; once they outnumber the cores it stops spinning between regions, and a decode step
        ran 1.65x slower on another thread than the one that had loaded the model (measured, 2 cores).
        Raises what building raised."""
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._stats_lock = threading.Lock()
        self._num_queued = 0  # _Add messages not yet applied
        # Grammar compiles have threads of their own (asyncio's default pool is shared with other work), in two
        # lanes: quick specs (grammar.is_quick: milliseconds whatever they ask) never queue behind slow ones, so a
        # burst of big grammars costs other clients nothing. Two threads a lane: compiles are CPU-bound
        # (llguidance, the GBNF converter's child) on cores shared with the stepping thread; more would only
        # slow each other and the running streams.
        self._quick_compiles = ThreadPoolExecutor(2, thread_name_prefix="kvserve-grammar-quick")
        self._slow_compiles = ThreadPoolExecutor(2, thread_name_prefix="kvserve-grammar")
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name="kvserve-engine", daemon=True
        )
        self._thread.start()
        error = built.get()
        if error is not None:
            raise error
        self.tokenizer = self._engine.tokenizer
        self.max_model_len = self._engine.max_model_len  # prompt + output tokens of one request, at most
        self.vocab_size = self._engine.vocab_size
        self.task: ServedTask = self._engine.task
        self.hidden_size = self._engine.model_config.hidden_size  # an embedding's values, at most

    # --- called from the event loop -------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Raise ParamError (a message for the client, naming the parameter) when the request can never be
        served. Call it once per prompt before generate()."""
        self._engine.validate(prompt_token_ids, params)

    async def compile_grammar(self, spec: GrammarSpec, received: float) -> CompiledGrammar:
        """The grammar for SamplingParams.grammar, compiled on a grammar thread (cached by spec). Raises
        ValueError with the grammar library's message when the spec is not a usable grammar, or when it is not
        ready COMPILE_SECONDS after `received` (time.monotonic() when the request arrived: its parsing counts
        too): a request is refused in time whatever it asks for. A refused request's compile that has not
        started never does (its future is cancelled with the wait), and a GBNF conversion running at the
        deadline is stopped; llguidance's compile cannot be (its own limits bound it): it ends in its thread
        and is cached, so asking again finds it ready."""
        grammars = self._engine.grammars
        compiled = grammars.cached(spec)  # a cached grammar never waits behind anyone's compile
        if compiled is not None:
            return compiled
        deadline = received + COMPILE_SECONDS
        lane = self._quick_compiles if is_quick(spec) else self._slow_compiles
        compiling = asyncio.wrap_future(lane.submit(grammars.compile, spec, deadline))
        try:
            return await asyncio.wait_for(compiling, max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise ValueError(
                f"the grammar was not ready within {COMPILE_SECONDS:g} s of the request: make it smaller"
            ) from None

    async def check_grammar(self, spec: GrammarSpec, received: float) -> None:
        """Raise ValueError as compile_grammar would when the spec does not build as a grammar, for one the
        request may never use (GrammarCompiler.check). One not checked COMPILE_SECONDS after `received` passes:
        it is not needed to serve the request, so its size is no reason to refuse it."""
        known = self._engine.grammars.checked(spec)
        if known is not None:
            if known:
                raise ValueError(known)
            return
        lane = self._quick_compiles if is_quick(spec) else self._slow_compiles
        checking = asyncio.wrap_future(lane.submit(self._engine.grammars.check, spec))
        try:
            await asyncio.wait_for(checking, max(received + COMPILE_SECONDS - time.monotonic(), 0.0))
        except TimeoutError:
            log.info("a grammar was not checked within %g s of its request; not refused", COMPILE_SECONDS)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a validated request now and return the stream of its delta outputs (a PoolingParams request's:
        one, finished, with its vector).

        Queueing at call time keeps the waiting count exact under a burst. `arrival_time` (time.monotonic(),
        now if None) is where the request's latencies count from: stamped here, not when the stepping thread
        takes it in, which may be a whole step later. Closing the stream early (client gone, task cancelled)
        aborts the request in the engine; so does dropping a stream never iterated.
        """
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._send(_Add(request_id, list(prompt_token_ids), params, arrival))
        outputs = self._outputs(request_id, stream)
        weakref.finalize(outputs, self._forget, request_id)
        return outputs

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None) if finished else self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step, plus requests not yet handed to the scheduler."""
        with self._stats_lock:
            s, queued = self._stats, self._num_queued
        return dataclasses.replace(s, num_waiting=s.num_waiting + queued)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for running requests to finish, then abort what is left."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        while self._streams and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.01)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        for lane in (self._quick_compiles, self._slow_compiles):
            lane.shutdown(wait=False, cancel_futures=True)  # one running ends by itself, bounded as above

    def _send(self, message: _Add | _Abort) -> None:
        with self._stats_lock:
            self._num_queued += isinstance(message, _Add)
            self._inbox.put(message)
        self._wake.set()

    # --- the stepping thread --------------------------------------------------------------------

    def _run(self, engine: Engine | Callable[[], Engine], built: queue.SimpleQueue) -> None:
        try:
            self._engine = engine if isinstance(engine, Engine) else engine()
            self._stats = self._engine.stats()
        except Exception as e:
            built.put(e)
            return
        built.put(None)
        while not self._stopped:
            self._apply_inbox()
            if not self._engine.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self._engine.step()
            except Exception:  # a bug or an out-of-memory: fail the requests of this batch, keep serving
                log.exception("engine step failed; aborting the running requests")
                outputs = self._engine.abort_all()
                for output in outputs:
                    output.error = RequestError("internal error while generating")
            self._deliver(outputs)
            self._stats = self._engine.stats()

    def _apply_inbox(self) -> None:
        while True:
            with self._stats_lock:  # a request leaves the inbox and enters the snapshot at once
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._num_queued -= isinstance(message, _Add)
                self._apply(message)
                self._stats = self._engine.stats()

    def _apply(self, message: _Add | _Abort) -> None:
        if isinstance(message, _Add):
            try:
                self._engine.add_validated_request(
                    message.request_id, message.prompt_token_ids, message.params, message.arrival_time
                )
            except (
                Exception
            ) as e:  # validated before queueing; a duplicate id (a race) or a bug: this one fails
                log.exception("could not add request %s", message.request_id)
                error = RequestOutput(
                    message.request_id, [], "", True, FinishReason.ABORT, error=RequestError(str(e))
                )
                self._deliver([error])
        else:
            output = self._engine.abort(message.request_id)
            if output is not None:
                self._deliver([output])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams: one call_soon_threadsafe per event loop (each wakes it with a write to
        its pipe; per output, a step of 256 streams made 256)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, handed in by_loop.items():
            loop.call_soon_threadsafe(_put_each, handed)


def _put_each(handed: list[tuple["_Stream", RequestOutput]]) -> None:
    for stream, output in handed:
        stream.put(output)
