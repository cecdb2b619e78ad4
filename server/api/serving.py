"""The serving pipeline every generating endpoint runs: a request's choices as engine requests, run
concurrently, answered either as an SSE stream of events or as one body that is the fold of the same events (so
the two cannot drift apart).

An endpoint says only what differs: how it builds its prompt, and its Shape (the events an engine output makes,
how they fold into the body, how its stream opens and ends).
"""

import asyncio
import contextlib
import logging
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from server.api import protocol as p
from server.api.errors import ApiError
from server.api.metrics import Metrics
from server.engine.async_engine import AsyncEngine
from server.engine.request import ParamError, PoolingParams, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

Disconnected = Callable[[], Awaitable[None]]
# The words the engine's errors open with when they name a field (SamplingParams' own, and the prompt): the param
# of the 400 they become.


@dataclass
class ServingState:
    engine: AsyncEngine
    model_name: str
    system_prompt: str | None
    max_queue: int
    metrics: Metrics
    received: float  # time.monotonic() when the request's whole body was here (RequestGuard)


@dataclass
class Choice:
    """One engine request: one choice of one prompt."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    counts_prompt: bool = True  # usage counts each prompt once, on its first choice
    prompt_text: str = ""  # for completions' echo
    started: bool = False  # a delta went out (completions' echo goes with the first)
    text_offset: int = 0  # completions' logprobs: where the next token starts in the choice's text
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    first_output_time: float | None = None
    last_output_time: float | None = None
    arrival_time: float | None = None  # time.monotonic() when handed to the engine: the request's one clock
    outputs: AsyncIterator[RequestOutput] | None = None  # the engine stream, once queued


@dataclass(slots=True)
class Event:
    """One server-sent event: its JSON, under its name for the APIs whose events are named."""

    data: BaseModel
    name: str | None = None

    def sse(self) -> str:
        head = f"event: {self.name}\n" if self.name else ""
        return f"{head}data: {sse_json(self.data)}\n\n"


# Characters that JSON leaves raw but Python's str.splitlines() (and so httpx's aiter_lines()) ends a line at: a
# model that writes one would cut its event in two for such a client. They can only stand inside JSON strings,
# where their escapes mean the same.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data: BaseModel) -> str:
    """data's JSON on one line for every SSE reader: JSON already escapes \\n, \\r and the other controls."""
    return data.model_dump_json().translate(_LINE_BREAKS_JSON_KEEPS)


class Shape(ABC):
    """What an endpoint's answer looks like: the events of its stream, and its body, the fold of those events.
    Streamed or not, an answer is the same events: the stream sends them, the body folds them. Each API's
    shape subclasses it; one that leaves a method out cannot be made."""

    end: str  # written after the last event ("data: [DONE]" in OpenAI's chat and completions)
    # Its closing events carry the whole answer (Responses' response.completed), so a stream folds every event
    # too; otherwise a stream folds nothing (per token, that would be work no one reads).
    closes_with_answer: bool

    @abstractmethod
    def opening(self, choices: list[Choice]) -> list[Event]:
        """Events before any output (chat: each choice's role; Responses: response.created)."""

    @abstractmethod
    def events(self, c: Choice, out: RequestOutput) -> list[Event]:
        """The events one engine output makes (none when there is nothing to send)."""

    @abstractmethod
    def closing(self, answer: Any, choices: list[Choice]) -> list[Event]:
        """Events after every choice finished; `answer` holds the fold of the events so far (None in a
        stream, unless closes_with_answer)."""

    @abstractmethod
    def failed(self, error: ApiError) -> list[Event]:
        """The events that end a stream that failed after it started."""

    @abstractmethod
    def empty(self, choices: list[Choice]) -> Any:
        """The answer before any event: what add() folds the events into."""

    @abstractmethod
    def add(self, answer: Any, event: BaseModel) -> None:
        """Fold one event's data into the answer."""

    @abstractmethod
    def response(self, answer: Any, choices: list[Choice]) -> BaseModel:
        """The non-streamed body, made of the answer once every event is folded in."""


def check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        why = f"model {model[:100]!r} does not exist; this server serves {state.model_name!r}"
        raise ApiError(404, why, "not_found_error", param="model", code="model_not_found")


def check_task(state: ServingState, task: str, what: str) -> None:
    """A 400 unless the model is served for `task` (embed, score: server/engine/pooling.py)."""
    served = state.engine.task.task
    if served != task:
        flag = "--task embed (or --pooling last|mean|cls)" if task == "embed" else "--task score"
        why = f"{what} needs a model served with {flag}; this one is served for {served}"
        raise ApiError(400, why, param="model", code="model_not_supported")


def check_queue(state: ServingState) -> None:
    if state.engine.stats().num_waiting >= state.max_queue:
        why = f"the server is busy ({state.max_queue} requests waiting); retry shortly"
        raise ApiError(429, why, "rate_limit_error", headers={"Retry-After": "1"})


def rest_of_context(state: ServingState, ids: list[int], param: str) -> int:
    """How many tokens may follow the prompt: the default output limit. A 400 naming `param` (where the prompt
    comes from) when none may."""
    rest = state.engine.max_model_len - len(ids)
    if rest < 1:
        why = f"the prompt ({len(ids)} tokens) fills the context of {state.engine.max_model_len} tokens"
        raise ApiError(400, why, param=param)
    return rest


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
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        logit_bias=body.logit_bias or {},
        speculative=body.speculative,
    )


def new_choices(
    state: ServingState,
    response_id: str,
    first_index: int,
    ids: list[int],
    params: SamplingParams | PoolingParams,
    n: int = 1,
    names: dict[str, str] | None = None,
) -> list[Choice]:
    """n choices of one prompt, validated once now, so that a bad request is a 400 before any stream starts.
    `names` renames the fields the engine's errors name (prompt, max_tokens) to the endpoint's own. A
    PoolingParams choice is a prefill-only request (pooled())."""
    try:
        state.engine.validate(ids, params)
    except ParamError as e:
        names = names or {}
        message = str(e)
        for name, own in names.items():  # the engine's words for the fields, in the endpoint's
            message = re.sub(rf"\b{name}\b", own, message)
        raise ApiError(400, message, param=names.get(e.param, e.param)) from None
    choices = []
    for j in range(n):
        choice_params = params
        if (
            isinstance(params, SamplingParams) and params.seed is not None and j
        ):  # seeded choices differ from each other, yet each is reproducible
            choice_params = replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)  # stays in int64
        index = first_index + j
        choices.append(Choice(index, f"{response_id}-{index}", ids, choice_params, counts_prompt=j == 0))
    return choices


async def answer(
    state: ServingState,
    choices: list[Choice],
    shape: Shape,
    log_id: str,
    disconnected: Disconnected,
    streamed: bool,
) -> BaseModel | AsyncIterator[str] | None:
    """Queue the choices and answer: an SSE stream of strings, the body, or None when the client went away."""
    # Handed to the engine now, while the request is being answered, so that the waiting count the next
    # request's 429 check reads already includes them.
    for c in choices:
        c.arrival_time = time.monotonic()
        c.outputs = state.engine.generate(c.request_id, c.prompt_ids, c.params, arrival_time=c.arrival_time)
    if streamed:
        return stream(state, choices, shape, log_id)
    folded = shape.empty(choices)
    async with contextlib.aclosing(events(state, choices, shape, folded, log_id, disconnected())) as each:
        async for _ in each:
            pass
    if any(c.finish_reason is None for c in choices):
        return None
    return shape.response(folded, choices)


async def events(
    state: ServingState, choices: list[Choice], shape: Shape, answer: Any, log_id: str, until=None
) -> AsyncIterator[Event]:
    """Every event of the answer in order, each folded into `answer` (unless None) before it goes out: the
    opening ones, those of each engine output, and the closing ones once every choice has finished."""

    def folded(e: Event) -> Event:
        if answer is not None:
            shape.add(answer, e.data)
        return e

    for e in shape.opening(choices):
        yield folded(e)
    async with contextlib.aclosing(run(state, choices, log_id, until)) as outputs:
        async for c, out in outputs:
            for e in shape.events(c, out):
                yield folded(e)
    if all(c.finish_reason is not None for c in choices):
        for e in shape.closing(answer, choices):
            yield folded(e)


async def run(
    state: ServingState, choices: list[Choice], log_id: str, until: Awaitable | None = None
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run the choices concurrently; yield each delta with its choice. Raises ApiError on a request the engine
    ended early: 400 when its own grammar failed midway, 500 when the engine did."""
    streams = [c.outputs for c in choices]
    try:
        async with contextlib.aclosing(merge(streams, until)) as outputs:
            async for i, out in outputs:
                c = choices[i]
                now = time.monotonic()
                if c.last_output_time is None:
                    c.first_output_time = now
                elif out.new_token_ids:
                    state.metrics.inter_token_latency.observe(now - c.last_output_time)
                c.last_output_time = now
                c.num_output_tokens = out.num_output_tokens
                c.num_cached_tokens = out.num_cached_tokens
                if out.error is not None and out.error.by_request:  # its grammar failed midway
                    raise ApiError(400, out.error.message)
                if out.error is not None:
                    raise ApiError(500, "internal error while generating", type="internal_error")
                if out.finished:
                    c.finish_reason = out.finish_reason.value
                    c.stop_string = out.stop_string
                    state.metrics.request_finished(c.finish_reason, out.times)
                yield c, out
    finally:
        for c in choices:
            if c.finish_reason is None:  # the client went away; the engine's abort output never reaches us
                state.metrics.request_finished("abort", None)
        log_request(log_id, choices)


async def pooled(
    state: ServingState,
    prompts: list[list[int]],
    params: PoolingParams,
    log_id: str,
    disconnected: Disconnected,
    param: str,
    shared_prefix: bool = False,
) -> list[RequestOutput] | None:
    """Run the prompts as prefill-only requests (embeddings, scores), concurrently; each one's final output (its
    vector in `pooled`), in order, or None when the client went away. Every prompt is validated before any is
    queued: a 400 names the first bad one by `param` and its index (when there are several), and nothing of it
    runs. Raises ApiError(500) when the engine failed, 503 when a drain aborted one; the others are aborted.

    shared_prefix: the prompts open alike (a reranker's prompt and query before each document). The first then
    runs alone, and the others find the blocks they share in the prefix cache: queued together, each would
    compute them, as a block is cached only once computed."""
    check_queue(state)
    response_id = f"pool-{uuid.uuid4().hex}"
    choices = []
    for i, ids in enumerate(prompts):
        try:
            choices += new_choices(state, response_id, i, ids, params, names={"prompt": param})
        except ApiError as e:
            if len(prompts) > 1:
                e.message, e.param = f"{param}[{i}]: {e.message}", f"{param}[{i}]"
            raise
    results: list[RequestOutput | None] = [None] * len(choices)
    waves = [choices[:1], choices[1:]] if shared_prefix and len(choices) > 1 else [choices]
    for wave in waves:
        for c in wave:
            c.arrival_time = time.monotonic()
            c.outputs = state.engine.generate(
                c.request_id, c.prompt_ids, c.params, arrival_time=c.arrival_time
            )
        async with contextlib.aclosing(run(state, wave, log_id, disconnected())) as outputs:
            async for c, out in outputs:
                if out.finished and out.pooled is None:  # aborted: the server is draining
                    why = "the server is shutting down; the request was stopped before its end"
                    raise ApiError(503, why, type="unavailable_error")
                if out.finished:
                    results[c.index] = out
        if any(results[c.index] is None for c in wave):
            return None
    return results


def stream(state: ServingState, choices: list[Choice], shape: Shape, log_id: str) -> AsyncIterator[str]:
    """The answer's events as SSE, then the shape's end. A client that goes away cancels the iteration
    (Starlette listens for the disconnect), which aborts the engine requests."""

    async def sse() -> AsyncIterator[str]:
        try:
            answer = shape.empty(choices) if shape.closes_with_answer else None
            async with contextlib.aclosing(events(state, choices, shape, answer, log_id)) as each:
                async for e in each:
                    yield e.sse()
        except ApiError as e:
            for ev in shape.failed(e):
                yield ev.sse()
        except Exception:
            log.exception("request %s failed while streaming", log_id)
            for ev in shape.failed(ApiError(500, "internal server error", type="internal_error")):
                yield ev.sse()
        if shape.end:
            yield shape.end

    return sse()


def usage(choices: list[Choice]) -> p.Usage:
    firsts = [c for c in choices if c.counts_prompt]  # a prompt counts once however many choices it has
    prompt_tokens = sum(len(c.prompt_ids) for c in firsts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(c.num_cached_tokens for c in firsts)),
    )


def log_request(log_id: str, choices: list[Choice]) -> None:
    u, c = usage(choices), choices[0]
    ttft = f"{c.first_output_time - c.arrival_time:.3f}s" if c.first_output_time else "-"
    reasons = ",".join(sorted({x.finish_reason or "abort (client gone)" for x in choices}))
    took = time.monotonic() - c.arrival_time
    log.info(
        "request %s: %d prompt + %d output tokens (%d cached), ttft %s, %.3fs, finish %s",
        *(
            log_id,
            u.prompt_tokens,
            u.completion_tokens,
            u.prompt_tokens_details.cached_tokens,
            ttft,
            took,
            reasons,
        ),
    )
    if log.isEnabledFor(logging.DEBUG):  # prompts are the users' data: only when asked for
        log.debug("request %s prompt ids: %s", log_id, c.prompt_ids)


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
