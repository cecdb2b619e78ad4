"""/v1/completions: prompts as text or token ids, each with n choices; echo and logprobs in OpenAI's legacy shape."""

import asyncio
import time
import uuid
from dataclasses import dataclass

from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.openai.shape import OpenAIShape
from server.api.openai.structured import constrain_output
from server.api.serving import Serving
from server.api.shape import Choice, Event
from server.engine.request import RequestOutput, TokenLogprob

MAX_PROMPTS = 256  # prompts in one completion request; each becomes n engine requests
LOGPROB_FIELDS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


async def completion(serving: Serving, body: p.CompletionRequest):
    """A CompletionResponse, an SSE stream of strings, or None when the client went away."""
    serving.check_model(body.model)
    tokenizer = serving.engine.tokenizer
    prompts = body.prompt if isinstance(body.prompt, list) and body.prompt else [body.prompt]
    if isinstance(prompts[0], int):
        prompts = [prompts]
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    serving.check_queue(len(prompts) * body.n, "prompt" if body.n == 1 else "n")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(
            400, "max_tokens must be at least 1 (0 only with echo: the prompt scored)", param="max_tokens"
        )
    # echo with max_tokens 0 (a prompt's log-likelihood, as evaluation harnesses ask): one token is drawn, as the
    # engine's prefill ends with one, and not shown
    params = serving.sampling_params(body, body.max_tokens or 1, body.logprobs)
    params.prompt_logprobs = body.echo and body.logprobs is not None
    await constrain_output(serving, params, body)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    choices = []

    def tokenized() -> list[list[int]]:  # off the event loop, as chat's prompts
        return [tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else x for x in prompts]

    for prompt, ids in zip(prompts, await asyncio.to_thread(tokenized), strict=True):
        for c in serving.choices(response_id, len(choices), ids, params, body.n):
            if body.echo:
                c.prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
            choices.append(c)
    shape = CompletionShape(serving, body, response_id, int(time.time()))
    return await serving.answer(choices, shape, body.stream)


@dataclass
class CompletionShape(OpenAIShape):
    body: p.CompletionRequest
    chunk_type = p.CompletionStreamResponse
    response_type = p.CompletionResponse

    def delta(self, c: Choice, out: RequestOutput) -> p.CompletionChoice | None:
        body = self.body
        text, logprobs = out.text, None
        if body.max_tokens == 0:  # the prompt alone: the drawn token is not the client's
            text, c.num_output_tokens = "", 0
            if out.finished and c.finish_reason != "abort":
                c.finish_reason, c.stop_string = "length", None
        if body.logprobs is not None:
            logprobs = p.CompletionLogprobs()
            if body.echo and not c.started:
                entries = out.prompt_logprobs or [None] * len(c.prompt_ids)
                self._add_logprobs(c, logprobs, c.prompt_ids, entries)
            if body.max_tokens:
                self._add_logprobs(c, logprobs, out.new_token_ids, out.logprobs or [])
        if body.echo and not c.started:
            text = c.prompt_text + text
        c.started = True
        if not text and not (logprobs and logprobs.tokens) and not out.finished:
            return None
        return p.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    def _add_logprobs(
        self, c: Choice, out: p.CompletionLogprobs, ids: list[int], entries: list[TokenLogprob | None]
    ) -> None:
        tokenizer = self.serving.engine.tokenizer
        for token_id, entry in zip(ids, entries, strict=True):
            token = tokenizer.token_text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob if entry else None)
            top = None
            if entry:  # the most likely, and the token itself wherever it ranks (OpenAI's: logprobs + 1)
                top = {tokenizer.token_text(t): lp for t, lp in entry.top}
                top.setdefault(token, entry.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(c.text_offset)
            c.text_offset += len(token)

    def opening(self, choices: list[Choice]) -> list[Event]:
        return []

    def empty(self, choices: list[Choice]) -> list[p.CompletionChoice]:
        return [
            p.CompletionChoice(
                index=c.index,
                text="",
                logprobs=p.CompletionLogprobs() if self.body.logprobs is not None else None,
            )
            for c in choices
        ]

    def add_choice(self, total: p.CompletionChoice, delta: p.CompletionChoice) -> None:
        total.text += delta.text
        total.finish_reason = delta.finish_reason
        if total.logprobs is not None:
            for name in LOGPROB_FIELDS:
                getattr(total.logprobs, name).extend(getattr(delta.logprobs, name))
