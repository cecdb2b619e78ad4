"""What OpenAI's chat and completions answers share: their Shape, but for the chunks each makes."""

from abc import abstractmethod

from pydantic import BaseModel

from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.protocol import Usage, error_body
from server.api.shape import Choice, Event, Shape, usage


class OpenAIShape(Shape):
    """What chat and completions streams share: data-only chunks, a usage chunk when the client asks for one,
    errors in OpenAI's body and [DONE] at the end. The answer is the list of choices; a subclass makes its
    chunks and folds a chunk's choice into the answer's."""

    body: p.SamplingFields  # the request: its stream_options say whether a usage chunk closes the stream
    end = "data: [DONE]\n\n"
    closes_with_answer = False

    @abstractmethod
    def chunk(self, choices: list, usage: Usage | None = None) -> BaseModel:
        """One chunk of the stream: these choices' deltas, or (with none) the usage."""

    @abstractmethod
    def add_choice(self, total: BaseModel, delta: BaseModel) -> None:
        """Fold one choice's delta into that choice of the answer."""

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
