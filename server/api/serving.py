"""Serving functions: an OpenAI request in, engine requests run, an OpenAI body or SSE chunks out.

Every choice of a request is one engine request, run concurrently with the others. A non-streamed body is
the fold of the same deltas a stream sends, so streamed and non-streamed text cannot drift apart.
"""

import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial

from pydantic import BaseModel

from model.tokenizer import Tokenizer
from server.api import protocol as p
from server.api.metrics import Metrics
from server.engine.async_engine import AsyncEngine, merge
from server.engine.request import RequestOutput, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)

MAX_PROMPTS = 256  # prompts in one completion request; each becomes n engine requests
MAX_ERROR_CHARS = 300


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error body; the app turns it into a response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> p.ErrorResponse:
        message = self.message[:MAX_ERROR_CHARS]  # bounded, whatever the input it quotes
        info = p.ErrorInfo(message=message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info)


@dataclass
class ServingState:
    engine: AsyncEngine
    model_name: str
    system_prompt: str | None
    max_queue: int
    metrics: Metrics


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
    first_output_time: float | None = None
    last_output_time: float | None = None
    request_time: float = field(default_factory=time.monotonic)
    outputs: AsyncIterator[RequestOutput] | None = None  # the engine stream, once queued


def queue_choices(state: ServingState, choices: list[Choice]) -> None:
    """Hand every choice to the engine now, while the request is being answered, so that the waiting count
    the next request's 429 check reads already includes them."""
    for c in choices:
        c.outputs = state.engine.generate(c.request_id, c.prompt_ids, c.params)


Disconnected = Callable[[], Awaitable[None]]
PARAM_NAMES = set(p.CompletionRequest.model_fields) | set(p.ChatCompletionRequest.model_fields)


# --- /v1/completions ----------------------------------------------------------------------------


async def completion(state: ServingState, body: p.CompletionRequest, log_id: str, disconnected: Disconnected):
    """A CompletionResponse, an SSE stream of strings, or None when the client went away."""
    check_model(state, body.model)
    check_queue(state)
    tokenizer = state.engine.tokenizer
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt else [body.prompt]
    if isinstance(prompts[0], int):
        prompts = [prompts]
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    params = sampling_params(body, body.max_tokens, body.logprobs)
    params.prompt_logprobs = body.echo and body.logprobs is not None
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    choices = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        for c in new_choices(state, response_id, len(choices), ids, params, body.n):
            if body.echo:
                c.prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
            choices.append(c)

    def delta(c: Choice, out: RequestOutput) -> p.CompletionChoice | None:
        text, logprobs = out.text, None
        if body.logprobs is not None:
            logprobs = p.CompletionLogprobs()
            if body.echo and not c.started:
                entries = out.prompt_logprobs or [None] * len(c.prompt_ids)
                add_completion_logprobs(tokenizer, c, logprobs, c.prompt_ids, entries)
            add_completion_logprobs(tokenizer, c, logprobs, out.new_token_ids, out.logprobs or [])
        if body.echo and not c.started:
            text = c.prompt_text + text
        c.started = True
        if not text and not (logprobs and logprobs.tokens) and not out.finished:
            return None
        return p.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    queue_choices(state, choices)
    if body.stream:
        chunk = partial(p.CompletionStreamResponse, id=response_id, created=created, model=state.model_name)
        return stream(state, body, choices, log_id, delta, chunk)

    with_logprobs = body.logprobs is not None
    results = [
        p.CompletionChoice(index=c.index, text="", logprobs=p.CompletionLogprobs() if with_logprobs else None)
        for c in choices
    ]
    async with contextlib.aclosing(run(state, choices, log_id, disconnected())) as outputs:
        async for c, out in outputs:
            if (d := delta(c, out)) is not None:
                total = results[c.index]
                total.text += d.text
                total.finish_reason = d.finish_reason
                for name in (
                    ("tokens", "token_logprobs", "top_logprobs", "text_offset") if with_logprobs else ()
                ):
                    getattr(total.logprobs, name).extend(getattr(d.logprobs, name))
    if any(c.finish_reason is None for c in choices):
        return None
    return p.CompletionResponse(
        id=response_id, created=created, model=state.model_name, choices=results, usage=usage(choices)
    )


def add_completion_logprobs(
    tokenizer: Tokenizer,
    c: Choice,
    out: p.CompletionLogprobs,
    ids: list[int],
    entries: list[TokenLogprob | None],
) -> None:
    for token_id, entry in zip(ids, entries, strict=True):
        token = token_text(tokenizer, token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob if entry else None)
        out.top_logprobs.append({token_text(tokenizer, t): lp for t, lp in entry.top} if entry else None)
        out.text_offset.append(c.text_offset)
        c.text_offset += len(token)


# --- /v1/chat/completions -----------------------------------------------------------------------


async def chat(state: ServingState, body: p.ChatCompletionRequest, log_id: str, disconnected: Disconnected):
    """A ChatCompletionResponse, an SSE stream of strings, or None when the client went away."""
    check_model(state, body.model)
    check_queue(state)
    tokenizer = state.engine.tokenizer
    ids = chat_prompt_ids(state, body.messages)
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = state.engine.max_model_len - len(ids)
        if max_tokens < 1:
            why = f"the prompt ({len(ids)} tokens) fills the context of {state.engine.max_model_len} tokens"
            raise ApiError(400, why, param="messages")
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    choices = new_choices(state, response_id, 0, ids, params, body.n)
    created = int(time.time())

    def delta(c: Choice, out: RequestOutput) -> p.ChatChunkChoice | None:
        logprobs = None
        if body.logprobs:
            logprobs = p.ChatLogprobs(content=[chat_logprob(tokenizer, e) for e in out.logprobs or []])
        if not out.text and not (logprobs and logprobs.content) and not out.finished:
            return None
        content = out.text if out.text or not out.finished else None
        delta = p.DeltaMessage(content=content)
        return p.ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=c.finish_reason)

    queue_choices(state, choices)
    if body.stream:
        chunk = partial(
            p.ChatCompletionStreamResponse, id=response_id, created=created, model=state.model_name
        )
        # OpenAI's streams open each choice with its role and empty content.
        opening = [
            p.ChatChunkChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))
            for c in choices
        ]
        return stream(state, body, choices, log_id, delta, chunk, opening)

    results = [
        p.ChatChoice(
            index=c.index,
            message=p.AssistantMessage(content=""),
            logprobs=p.ChatLogprobs(content=[]) if body.logprobs else None,
        )
        for c in choices
    ]
    async with contextlib.aclosing(run(state, choices, log_id, disconnected())) as outputs:
        async for c, out in outputs:
            if (d := delta(c, out)) is not None:
                total = results[c.index]
                total.message.content += d.delta.content or ""
                if body.logprobs:
                    total.logprobs.content.extend(d.logprobs.content)
                total.finish_reason = d.finish_reason
    if any(c.finish_reason is None for c in choices):
        return None
    return p.ChatCompletionResponse(
        id=response_id, created=created, model=state.model_name, choices=results, usage=usage(choices)
    )


def chat_prompt_ids(state: ServingState, messages: list[p.ChatMessage], add_generation_prompt: bool = True):
    """The prompt the chat template makes of the messages, after the server's system prompt if they have none."""
    dicts = [m.model_dump(exclude_none=True) for m in messages]
    for m in dicts:
        if m["role"] == "developer":
            m["role"] = "system"
    if state.system_prompt and not any(m["role"] == "system" for m in dicts):
        dicts.insert(0, {"role": "system", "content": state.system_prompt})
    tokenizer = state.engine.tokenizer
    try:
        # The template writes the special tokens (BOS, role markers) itself.
        return tokenizer.encode(tokenizer.apply_chat_template(dicts, add_generation_prompt))
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


def chat_logprob(tokenizer: Tokenizer, entry: TokenLogprob) -> p.TokenLogprob:
    def top(token_id: int, logprob: float) -> p.TopLogprob:
        return p.TopLogprob(
            token=token_text(tokenizer, token_id),
            logprob=logprob,
            bytes=list(token_bytes(tokenizer, token_id)),
        )

    chosen = top(entry.token_id, entry.logprob)
    return p.TokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top])


# --- shared -------------------------------------------------------------------------------------


def check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        why = f"model {model[:100]!r} does not exist; this server serves {state.model_name!r}"
        raise ApiError(404, why, "not_found_error", param="model", code="model_not_found")


def check_queue(state: ServingState) -> None:
    if state.engine.stats().num_waiting >= state.max_queue:
        why = f"the server is busy ({state.max_queue} requests waiting); retry shortly"
        raise ApiError(429, why, "rate_limit_error", headers={"Retry-After": "1"})


def sampling_params(body: p.SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
    )


def new_choices(
    state: ServingState, response_id: str, first_index: int, ids: list[int], params: SamplingParams, n: int
) -> list[Choice]:
    """n choices of one prompt, checked now so that a bad request is a 400 before any stream starts."""
    try:
        state.engine.engine.validate(ids, params)
    except ValueError as e:
        message = str(e)
        word = message.split(" ", 1)[0]
        raise ApiError(400, message, param=word if word in PARAM_NAMES else None) from None
    choices = []
    for j in range(n):
        # Seeded choices must differ from each other, yet each stays reproducible.
        choice_params = replace(params, seed=params.seed + j) if params.seed is not None and j else params
        index = first_index + j
        choices.append(Choice(index, f"{response_id}-{index}", ids, choice_params, counts_prompt=j == 0))
    return choices


async def run(
    state: ServingState, choices: list[Choice], log_id: str, until: Awaitable | None = None
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run the choices concurrently; yield each delta with its choice. Raises ApiError(500) on an engine failure."""
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
                if out.error is not None:
                    raise ApiError(500, "internal error while generating", type="internal_error")
                if out.finished:
                    c.finish_reason = out.finish_reason.value
                    state.metrics.request_finished(c.finish_reason, out.times)
                yield c, out
    finally:
        for c in choices:
            if c.finish_reason is None:  # the client went away; the engine's abort output never reaches us
                state.metrics.request_finished("abort", None)
        log_request(log_id, choices)


def stream(
    state: ServingState, body: p.SamplingFields, choices: list[Choice], log_id: str, delta, chunk, opening=()
) -> AsyncIterator[str]:
    """SSE events: opening chunks, one chunk per delta, the usage chunk if asked for, then [DONE]. A client that
    goes away cancels the iteration (Starlette listens for the disconnect), which aborts the engine requests."""

    async def events() -> AsyncIterator[str]:
        try:
            for d in opening:
                yield sse(chunk(choices=[d]))
            async with contextlib.aclosing(run(state, choices, log_id)) as outputs:
                async for c, out in outputs:
                    d = delta(c, out)
                    if d is not None:
                        yield sse(chunk(choices=[d]))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse(chunk(choices=[], usage=usage(choices)))
        except ApiError as e:
            yield sse(e.body())
        except Exception:
            log.exception("request %s failed while streaming", log_id)
            yield sse(ApiError(500, "internal server error", type="internal_error").body())
        yield "data: [DONE]\n\n"

    return events()


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


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
    ttft = f"{c.first_output_time - c.request_time:.3f}s" if c.first_output_time else "-"
    reasons = ",".join(sorted({x.finish_reason or "abort (client gone)" for x in choices}))
    took = time.monotonic() - c.request_time
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


# --- tokens as text -----------------------------------------------------------------------------


def _byte_level_table() -> dict[str, int]:
    # Byte-level BPE (GPT-2 style) spells each byte as a visible character: printable Latin-1 bytes as
    # themselves, the other 68 bytes as chr(256), chr(257), ... in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The exact bytes of one token, also for a token that holds only part of a UTF-8 character."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.id_to_token(token_id) or ""
    if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):  # SentencePiece byte fallback
        return bytes([int(m[1], 16)])
    if piece and all(ch in BYTE_LEVEL for ch in piece):
        return bytes(BYTE_LEVEL[ch] for ch in piece)
    return text.encode()


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as a string; a partial UTF-8 character is spelled as OpenAI does, e.g. 'bytes:\\xe4\\xbd'."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
