"""/v1/chat/completions: messages rendered through the chat template, n choices, logprobs in the chat shape."""

import time
import uuid
from dataclasses import dataclass

from server.api import protocol as p
from server.api.choices import (
    Choice,
    Disconnected,
    ServingState,
    answer,
    check_model,
    check_queue,
    new_choices,
    sampling_params,
)
from server.api.errors import ApiError
from server.engine.request import RequestOutput, TokenLogprob


async def chat(state: ServingState, body: p.ChatCompletionRequest, log_id: str, disconnected: Disconnected):
    """A ChatCompletionResponse, an SSE stream of strings, or None when the client went away."""
    check_model(state, body.model)
    check_queue(state)
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
    shape = ChatShape(state, body, response_id, int(time.time()))
    return await answer(state, body, choices, shape, log_id, disconnected)


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


@dataclass
class ChatShape:
    state: ServingState
    body: p.ChatCompletionRequest
    response_id: str
    created: int

    def delta(self, c: Choice, out: RequestOutput) -> p.ChatChunkChoice | None:
        logprobs = None
        if self.body.logprobs:
            logprobs = p.ChatLogprobs(content=[self._logprob(e) for e in out.logprobs or []])
        if not out.text and not (logprobs and logprobs.content) and not out.finished:
            return None
        content = out.text if out.text or not out.finished else None
        delta = p.DeltaMessage(content=content)
        return p.ChatChunkChoice(index=c.index, delta=delta, logprobs=logprobs, finish_reason=c.finish_reason)

    def _logprob(self, entry: TokenLogprob) -> p.TokenLogprob:
        tokenizer = self.state.engine.tokenizer

        def top(token_id: int, logprob: float) -> p.TopLogprob:
            return p.TopLogprob(
                token=tokenizer.token_text(token_id),
                logprob=logprob,
                bytes=list(tokenizer.token_bytes(token_id)),
            )

        chosen = top(entry.token_id, entry.logprob)
        return p.TokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top])

    def opening(self, choices: list[Choice]) -> list[p.ChatChunkChoice]:
        # OpenAI's streams open each choice with its role and empty content.
        return [
            p.ChatChunkChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))
            for c in choices
        ]

    def chunk(self, choices: list[p.ChatChunkChoice], usage: p.Usage | None = None):
        return p.ChatCompletionStreamResponse(
            id=self.response_id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
        )

    def empty(self, c: Choice) -> p.ChatChoice:
        logprobs = p.ChatLogprobs(content=[]) if self.body.logprobs else None
        return p.ChatChoice(index=c.index, message=p.AssistantMessage(content=""), logprobs=logprobs)

    def add(self, total: p.ChatChoice, delta: p.ChatChunkChoice) -> None:
        total.message.content += delta.delta.content or ""
        if total.logprobs is not None:
            total.logprobs.content.extend(delta.logprobs.content)
        total.finish_reason = delta.finish_reason

    def response(self, choices: list[p.ChatChoice], usage: p.Usage) -> p.ChatCompletionResponse:
        return p.ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=usage,
        )
