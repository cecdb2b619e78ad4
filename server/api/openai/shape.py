"""What OpenAI's chat and completions answers share: their Shape, but for the choices each makes."""

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel

from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.protocol import Usage, error_body
from server.api.serving import Serving
from server.api.shape import Choice, Event, Shape, usage
from server.engine.request import RequestOutput, TokenLogprob


@dataclass
class OpenAIShape(Shape):
    """What chat and completions answers share: a chunk per choice's delta, a usage chunk when the client asks
    for one, errors in OpenAI's body and [DONE] at the end; the body is the list of choices, each the fold of its
    deltas. A subclass names its chunk and response types, makes a choice's delta and folds it into that choice."""

    serving: Serving
    body: p.SamplingFields  # the request: its stream_options say whether a usage chunk closes the stream
    response_id: str
    created: int
    chunk_type: ClassVar[type[BaseModel]]  # one event of the stream (with no choices: the usage)
    response_type: ClassVar[type[BaseModel]]  # the non-streamed body
    end = "data: [DONE]\n\n"
    closes_with_answer = False

    @abstractmethod
    def delta(self, c: Choice, out: RequestOutput) -> BaseModel | None:
        """The choice's delta from one engine output, or None when there is nothing to send."""

    @abstractmethod
    def add_choice(self, total: BaseModel, delta: BaseModel) -> None:
        """Fold one choice's delta into that choice of the answer."""

    def events(self, c: Choice, out: RequestOutput) -> list[Event]:
        d = self.delta(c, out)
        return [] if d is None else [Event(self.chunk([d], self.usage_so_far(c)))]

    def usage_so_far(self, c: Choice) -> Usage | None:
        """With vLLM's continuous_usage_stats, what a chunk of this choice carries: its prompt and its output so
        far (every choice's chunks count their prompt); else None."""
        options = self.body.stream_options
        if options is None or not options.continuous_usage_stats:
            return None
        return usage([dataclasses.replace(c, counts_prompt=True)])

    def chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        """One chunk of the stream: these choices' deltas, or (with none) the usage."""
        return self.chunk_type(
            id=self.response_id,
            created=self.created,
            model=self.serving.model_name,
            choices=choices,
            usage=usage,
        )

    def closing(self, answer: list, choices: list[Choice]) -> list[Event]:
        options = self.body.stream_options
        if options is None or not options.include_usage:
            return []
        return [Event(self.chunk([], usage(choices)))]

    def failed(self, error: ApiError) -> list[Event]:
        return [Event(error_body(error))]

    def add(self, answer: list, event: BaseModel) -> None:
        for d in event.choices:
            self.add_choice(answer[d.index], d)

    def response(self, answer: list, choices: list[Choice]) -> BaseModel:
        return self.response_type(
            id=self.response_id,
            created=self.created,
            model=self.serving.model_name,
            choices=answer,
            usage=usage(choices),
        )


def token_logprob(serving: Serving, entry: TokenLogprob) -> p.TokenLogprob:
    """A sampled token's logprob and its alternatives, as chat's and Responses' logprobs show them."""
    tokenizer = serving.engine.tokenizer

    def top(token_id: int, logprob: float) -> p.TopLogprob:
        return p.TopLogprob(
            token=tokenizer.token_text(token_id), logprob=logprob, bytes=list(tokenizer.token_bytes(token_id))
        )

    chosen = top(entry.token_id, entry.logprob)
    return p.TokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top])
