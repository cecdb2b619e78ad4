"""What an endpoint's answer looks like: the Shape each API's endpoint subclasses (the events an engine output
makes, how they fold into the body, how its stream opens and ends), the Choice records it reads and the Events
it makes. The serving pipeline (serving.py) runs the choices and calls the shape; the shape never calls it.
"""

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from server.api import protocol as p
from server.api.errors import ApiError
from server.engine.request import PoolingParams, RequestOutput, SamplingParams


@dataclass
class Choice:
    """One engine request: one choice of one prompt."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: a prefill-only request (Serving.pooled())
    counts_prompt: bool = True  # usage counts each prompt once, on its first choice
    prompt_text: str = ""  # for completions' echo
    started: bool = False  # a delta went out (completions' echo goes with the first)
    text_offset: int = 0  # completions' logprobs: where the next token starts in the choice's text
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_reasoning_tokens: int = 0  # of its output: its reply parser counts them (server/api/reasoning.py)
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


def usage(choices: list[Choice]) -> p.Usage:
    firsts = [c for c in choices if c.counts_prompt]  # a prompt counts once however many choices it has
    prompt_tokens = sum(len(c.prompt_ids) for c in firsts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return p.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(c.num_cached_tokens for c in firsts)),
        completion_tokens_details=p.CompletionTokensDetails(
            reasoning_tokens=sum(c.num_reasoning_tokens for c in choices)
        ),
    )
