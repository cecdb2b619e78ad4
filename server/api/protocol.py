"""Request and response bodies of the OpenAI-compatible API, shaped as OpenAI's.

Unknown request fields are ignored (clients send extras); fields kvserve knows but does not support are
rejected by name, so a client never silently gets behaviour it did not ask for. A JSON null means "the
default", as in OpenAI's API.
"""

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_CHOICES = 16
MAX_STOP = 16

FinishReasonName = Literal["stop", "length", "abort"]
# Fields kvserve knows but does not support yet, with the one value that means "not used" (as does leaving
# them out); any other value is a 400 naming the field rather than silently ignored.
UNSUPPORTED = {
    "best_of": 1,
    "suffix": "",
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
}


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


def _valid_unicode(value: str) -> str:
    # JSON can escape lone UTF-16 surrogates ("\ud800"): no text at all, and the tokenizer fails on them.
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every string the server tokenizes or matches


def _one_of(handler, value: Any, message: str) -> Any:
    # Pydantic reports a failed union once per member ("prompt.str", "prompt.list[int]", ...); say it once.
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(message) from None


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """The sampling fields both endpoints share."""

    model: str | None = Field(None, description="The served model name; may be left out.")
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off.")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop: Text | list[Text] | None = Field(
        None, description=f"Up to {MAX_STOP} strings; never part of the text."
    )
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    logit_bias: dict[int, float] | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit; at most 300."
    )
    best_of: int | None = Field(None, description="Not supported yet (only 1).")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(value)}")
        return value

    @field_validator(*UNSUPPORTED, check_fields=False)
    @classmethod
    def _refuse_unsupported(cls, value, info):
        neutral = UNSUPPORTED[info.field_name]
        if value != neutral:
            raise ValueError(f"not supported by kvserve; leave it out or send {json.dumps(neutral)}")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists; "
        "each prompt gets n choices."
    )
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5, description="The sampled token's logprob plus the top N.")
    echo: bool = Field(False, description="Put the prompt before the completion (with logprobs: theirs too).")
    suffix: str | None = Field(None, description="Not supported yet.")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value, handler):
        return _one_of(
            handler, value, "must be a string, a list of strings, a list of token ids or a list of lists"
        )


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(Body):
    # "developer" is OpenAI's newer name for "system"; the chat template sees "system"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_content(cls, value, handler):
        return _one_of(
            handler, value, "must be a string or a list of text parts ({'type': 'text', 'text': ...})"
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(None, description="Not supported yet.")
    tool_choice: Any = Field(None, description="Not supported yet (only 'none').")
    functions: list[Any] | None = Field(None, description="Not supported yet.")
    response_format: dict[str, Any] | None = Field(None, description="Not supported yet (only text).")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# --- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionStreamResponse(CompletionResponse):
    """One server-sent event of a streamed completion; the last one (when asked for) has usage and no choices."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_nulls(self, handler) -> dict[str, Any]:
        # As OpenAI: the role only in a choice's first chunk, and the last chunk's delta may be {}.
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One server-sent event of a streamed chat completion; the last one (when asked for) has usage and no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(Body):
    """A prompt (tokenized as /v1/completions does) or chat messages (rendered as /v1/chat/completions does)."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(
        True, description="For a prompt: add the tokenizer's BOS/EOS if it has them."
    )
    add_generation_prompt: bool = Field(
        True, description="For messages: end with the assistant's turn opening."
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
