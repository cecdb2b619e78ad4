"""The serving pipeline every endpoint runs, as one object: Serving. It checks a request against the model, the
task and the queue, makes its choices (engine requests), runs them concurrently and answers either as an SSE
stream of events or as one body that is the fold of the same events (so the two cannot drift apart); or, for
embeddings and scores, pools the prompts.

An endpoint says only what differs: how it builds its prompt, and its Shape (shape.py: the events an engine
output makes, how they fold into the body, how its stream opens and ends).
"""

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from server.api import protocol as p
from server.api.errors import ApiError
from server.api.metrics import Metrics
from server.api.reasoning import ReasoningFormat
from server.api.shape import Choice, Event, Shape, usage
from server.engine.async_engine import AsyncEngine
from server.engine.request import (
    CONTEXT_LENGTH_EXCEEDED,
    ParamError,
    PoolingParams,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)

Disconnected = Callable[[], Awaitable[None]]


@dataclass
class Serving:
    """One request's way through the pipeline: the engine client and the server's settings it is served under,
    and the request's own id, arrival and disconnect. The routes' Ready dependency (routes.py) makes one per
    request, from the app's state and the request, so that an endpoint is `endpoint(serving, body)`."""

    engine: AsyncEngine
    model_name: str
    system_prompt: str | None
    max_queue: int
    metrics: Metrics
    request_id: str  # the X-Request-Id: what the request's log lines name
    received: float  # time.monotonic() when the request's whole body was here (RequestGuard)
    disconnected: Disconnected  # returns when the client has gone away
    reasoning: ReasoningFormat | None = None  # how the model writes its reasoning; None: not parsed
    model_aliases: tuple[str, ...] = ()  # other names a request's `model` may give
    log_requests: bool = True  # a line per finished request
    grammar_param: str | None = None  # the field its grammar came from: named if the grammar fails midway

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.model_aliases:
            why = f"model {model[:100]!r} does not exist; this server serves {self.model_name!r}"
            raise ApiError(404, why, "not_found_error", param="model", code="model_not_found")

    def check_task(self, task: str, what: str) -> None:
        """A 400 unless the model is served for `task` (embed, score: server/engine/pooling.py)."""
        served = self.engine.task.task
        if served != task:
            flag = "--task embed (or --pooling last|mean|cls)" if task == "embed" else "--task score"
            why = f"{what} needs a model served with {flag}; this one is served for {served}"
            raise ApiError(400, why, param="model", code="model_not_supported")

    def check_queue(self, sequences: int = 1, param: str = "n") -> None:
        """A request of `sequences` engine requests (prompts x n) fits in the queue: a 429 while the queue is too
        full for them, a 400 naming `param` if they alone are more than it holds (one request must not fill
        the queue and turn every other client away). Checked as a request arrives, and again as its choices are
        queued (answer): the prompt is tokenized in between, off the event loop, while others arrive."""
        if sequences > max(self.max_queue, 1):
            why = f"{sequences} sequences (prompts x n) are more than the server queues (--max-queue {self.max_queue})"
            raise ApiError(400, why, param=param)
        waiting = self.engine.stats().num_waiting
        if waiting + sequences > self.max_queue:
            why = f"the server is busy ({waiting} requests waiting, {self.max_queue} at most); retry shortly"
            raise ApiError(429, why, "rate_limit_error", headers={"Retry-After": "1"})

    def rest_of_context(self, ids: list[int], param: str) -> int:
        """How many tokens may follow the prompt: the default output limit. A 400 naming `param` (where the
        prompt comes from) when none may."""
        rest = self.engine.max_model_len - len(ids)
        if rest < 1:
            why = (
                f"the prompt ({len(ids)} tokens) leaves no room for a reply within the maximum context length of "
                f"{self.engine.max_model_len} tokens"
            )
            raise ApiError(400, why, param=param, code=CONTEXT_LENGTH_EXCEEDED)
        return rest

    @staticmethod
    def sampling_params(body: p.Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            logit_bias=body.logit_bias or {},
            speculative=body.speculative,
        )

    def choices(
        self,
        response_id: str,
        first_index: int,
        ids: list[int],
        params: SamplingParams | PoolingParams,
        n: int = 1,
        names: dict[str, str] | None = None,
    ) -> list[Choice]:
        """n choices of one prompt, validated once now, so that a bad request is a 400 before any stream
        starts. `names` renames the fields the engine's errors name (prompt, max_tokens) to the endpoint's own.
        A PoolingParams choice is a prefill-only request (pooled())."""
        try:
            self.engine.validate(ids, params)
        except ParamError as e:
            names = names or {}
            message = str(e)
            for name, own in names.items():  # the engine's words for the fields, in the endpoint's
                message = re.sub(rf"\b{name}\b", own, message)
            raise ApiError(400, message, param=names.get(e.param, e.param), code=e.code) from None
        choices = []
        for j in range(n):
            choice_params = params
            # seeded choices differ from each other, yet each is reproducible (the seed stays in int64)
            if isinstance(params, SamplingParams) and params.seed is not None and j:
                choice_params = replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)
            index = first_index + j
            choices.append(Choice(index, f"{response_id}-{index}", ids, choice_params, counts_prompt=j == 0))
        return choices

    async def answer(
        self, choices: list[Choice], shape: Shape, streamed: bool
    ) -> BaseModel | AsyncIterator[str] | None:
        """Queue the choices and answer: an SSE stream of strings, the body, or None when the client went
        away."""
        # Handed to the engine now, while the request is being answered, so that the waiting count the next
        # request's 429 check reads already includes them; checked with nothing awaited between.
        self.check_queue(len(choices))
        self._queue(choices)
        if streamed:
            return self._stream(choices, shape)
        folded = shape.empty(choices)
        async with contextlib.aclosing(self._events(choices, shape, folded, self.disconnected())) as each:
            async for _ in each:
                pass
        if any(c.finish_reason is None for c in choices):
            return None
        return shape.response(folded, choices)

    async def pooled(
        self, prompts: list[list[int]], params: PoolingParams, param: str, shared_prefix: bool = False
    ) -> list[RequestOutput] | None:
        """Run the prompts as prefill-only requests (embeddings, scores), concurrently; each one's final output
        (its vector in `pooled`), in order, or None when the client went away. Every prompt is validated before
        any is queued: a 400 names the first bad one by `param` and its index (when there are several), and
        nothing of it runs. Raises ApiError(500) when the engine failed, 503 when a drain aborted one; the
        others are aborted.

        shared_prefix: the prompts open alike (a reranker's prompt and query before each document). The first
        then runs alone, and the others find the blocks they share in the prefix cache: queued together, each
        would compute them, as a block is cached only once computed."""
        self.check_queue()
        response_id = f"pool-{uuid.uuid4().hex}"
        choices = []
        for i, ids in enumerate(prompts):
            try:
                choices += self.choices(response_id, i, ids, params, names={"prompt": param})
            except ApiError as e:
                if len(prompts) > 1:
                    e.message, e.param = f"{param}[{i}]: {e.message}", f"{param}[{i}]"
                raise
        results: list[RequestOutput | None] = [None] * len(choices)
        waves = [choices[:1], choices[1:]] if shared_prefix and len(choices) > 1 else [choices]
        for wave in waves:
            self._queue(wave)
            async with contextlib.aclosing(self._run(wave, self.disconnected())) as outputs:
                async for c, out in outputs:
                    if out.finished and out.pooled is None:  # aborted: the server is draining
                        why = "the server is shutting down; the request was stopped before its end"
                        raise ApiError(503, why, type="unavailable_error")
                    if out.finished:
                        results[c.index] = out
            if any(results[c.index] is None for c in wave):
                return None
        return results

    def _queue(self, choices: list[Choice]) -> None:
        for c in choices:
            c.arrival_time = time.monotonic()
            c.outputs = self.engine.generate(
                c.request_id, c.prompt_ids, c.params, arrival_time=c.arrival_time
            )

    def _stream(self, choices: list[Choice], shape: Shape) -> AsyncIterator[str]:
        """The answer's events as SSE, then the shape's end. A client that goes away cancels the iteration
        (Starlette listens for the disconnect), which aborts the engine requests."""

        async def sse() -> AsyncIterator[str]:
            try:
                answer = shape.empty(choices) if shape.closes_with_answer else None
                async with contextlib.aclosing(self._events(choices, shape, answer)) as each:
                    async for e in each:
                        yield e.sse()
            except ApiError as e:
                for ev in shape.failed(e):
                    yield ev.sse()
            except Exception:
                log.exception("request %s failed while streaming", self.request_id)
                for ev in shape.failed(ApiError(500, "internal server error", type="internal_error")):
                    yield ev.sse()
            if shape.end:
                yield shape.end

        return sse()

    async def _events(
        self, choices: list[Choice], shape: Shape, answer: Any, until: Awaitable | None = None
    ) -> AsyncIterator[Event]:
        """Every event of the answer in order, each folded into `answer` (unless None) before it goes out: the
        opening ones, those of each engine output, and the closing ones once every choice has finished."""

        def folded(e: Event) -> Event:
            if answer is not None:
                shape.add(answer, e.data)
            return e

        for e in shape.opening(choices):
            yield folded(e)
        async with contextlib.aclosing(self._run(choices, until)) as outputs:
            async for c, out in outputs:
                for e in shape.events(c, out):
                    yield folded(e)
        if all(c.finish_reason is not None for c in choices):
            for e in shape.closing(answer, choices):
                yield folded(e)

    async def _run(
        self, choices: list[Choice], until: Awaitable | None = None
    ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Run the choices concurrently; yield each delta with its choice. Raises ApiError on a request the
        engine ended early: 400 when its own grammar failed midway, 500 when the engine did."""
        streams = [c.outputs for c in choices]
        try:
            async with contextlib.aclosing(merge(streams, until)) as outputs:
                async for i, out in outputs:
                    c = choices[i]
                    now = time.monotonic()
                    if c.last_output_time is None:
                        c.first_output_time = now
                    elif out.new_token_ids:  # a delta of k tokens (merged, or drafted): k gaps of 1/k of it
                        gap = (now - c.last_output_time) / len(out.new_token_ids)
                        for _ in out.new_token_ids:
                            self.metrics.inter_token_latency.observe(gap)
                    c.last_output_time = now
                    c.num_output_tokens = out.num_output_tokens
                    c.num_cached_tokens = out.num_cached_tokens
                    if out.error is not None and out.error.by_request:  # its grammar failed midway
                        raise ApiError(400, out.error.message, param=self.grammar_param)
                    if out.error is not None:
                        raise ApiError(500, "internal error while generating", type="internal_error")
                    if out.finished:
                        c.finish_reason = out.finish_reason.value
                        c.stop_string = out.stop_string
                        self.metrics.request_finished(c.finish_reason, out.times)
                    yield c, out
        finally:
            # an unfinished choice: the client went away, and the engine's abort output never reaches us
            for c in choices:
                if c.finish_reason is None:
                    self.metrics.request_finished("abort", None)
            self._log(choices)

    def _log(self, choices: list[Choice]) -> None:
        if not self.log_requests:
            return
        u, c = usage(choices), choices[0]
        ttft = f"{c.first_output_time - c.arrival_time:.3f}s" if c.first_output_time else "-"
        reasons = ",".join(sorted({x.finish_reason or "abort (client gone)" for x in choices}))
        took = time.monotonic() - c.arrival_time
        log.info(
            "request %s: %d prompt + %d output tokens (%d cached), ttft %s, %.3fs, finish %s",
            *(
                self.request_id,
                u.prompt_tokens,
                u.completion_tokens,
                u.prompt_tokens_details.cached_tokens,
                ttft,
                took,
                reasons,
            ),
        )
        if log.isEnabledFor(logging.DEBUG):  # prompts are the users' data: only when asked for
            log.debug("request %s prompt ids: %s", self.request_id, c.prompt_ids)


async def merge(
    streams: list[AsyncIterator], until: Awaitable | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come (the n choices of one HTTP request), each with its
    stream's index. Ends early when `until` completes (the client went away); an exception in a stream is
    raised here. On exit the streams are cancelled, which aborts their unfinished requests in the engine.
    """
    if len(streams) == 1 and until is None:  # one streamed choice: its items as they are, no hop per token
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    inbox: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                inbox.put_nowait((i, item))
        except Exception as e:
            inbox.put_nowait((i, e))
        inbox.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    if until is not None:
        watcher = asyncio.ensure_future(until)
        watcher.add_done_callback(lambda f: f.cancelled() or inbox.put_nowait((-1, end)))
        tasks.append(watcher)
    num_open = len(streams)
    try:
        while num_open:
            i, item = await inbox.get()
            if i < 0:
                return
            if item is end:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        # No await here: under a cancelled (anyio) scope it would be cancelled again at once. The tasks
        # run their own cleanup (generate()'s abort) on the next loop turn.
        for task in tasks:
            task.cancel()
