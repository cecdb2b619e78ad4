"""Request and response bodies of OpenAI's chat, completions and embeddings APIs, shaped as OpenAI's. The
server's own bodies (models, tokenize, health, errors, rerank and score) are on the shared floor,
server/api/protocol.py.

Request bodies follow server/api/protocol.py's rules: unknown fields are ignored, null means the default, and
what kvserve cannot do is refused by name.
"""

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from server.api.protocol import (
    MAX_POOLED_INPUTS,
    MAX_STOP,
    Body,
    ChatMessage,
    ChatTool,
    Effort,
    EmbeddingUsage,
    JsonObject,
    Sampling,
    Text,
    Usage,
    one_of,
)

MAX_CHOICES = 16
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

FinishReasonName = Literal["stop", "length", "abort", "tool_calls"]
# Fields kvserve knows but does not support, with the one value that means "not used" (as does leaving them
# out); any other value is a 400 naming the field rather than silently ignored.
UNSUPPORTED = {
    "best_of": 1,
    "suffix": "",
    "functions": [],  # OpenAI's deprecated spelling of tools
    "function_call": "none",
}


class StreamOptions(Body):
    include_usage: bool = Field(False, description="A last chunk, with no choices, carries the usage.")
    continuous_usage_stats: bool = Field(
        False,
        description="vLLM's: every chunk also carries its choice's usage so far (its prompt and output).",
    )


class JsonSchemaFormat(Body):
    name: str = Field("response", max_length=64, description="The schema's name (not used).")
    description: str | None = None
    schema_: JsonObject | None = Field(
        None, alias="schema", description="A JSON schema the output will match; left out: any JSON object."
    )
    strict: bool | None = Field(
        None,
        description="true: the schema's keywords no grammar can enforce (uniqueItems, not, if/then/else) are a 400; "
        "otherwise they are ignored. Every other keyword is enforced either way.",
    )


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @property
    def strict(self) -> bool:
        return self.json_schema is not None and bool(self.json_schema.strict)

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self

    def output_schema(self) -> dict | None:
        """The JSON schema the output must match, or None for free text."""
        if self.type == "json_schema" and self.json_schema.schema_ is not None:
            return self.json_schema.schema_
        return None if self.type == "text" else {"type": "object"}


class StructuredOutputs(Body):
    """vLLM's structured outputs: exactly one of the constraints."""

    json_: JsonObject | Text | None = Field(None, alias="json", description="A JSON schema.")
    regex: Text | None = Field(None, description="A regular expression (Rust regex syntax).")
    choice: list[Text] | None = Field(None, min_length=1, description="The output is one of these strings.")
    grammar: Text | None = Field(None, description="A context-free grammar, GBNF (llama.cpp's) or Lark.")
    json_object: bool | None = Field(None, description="Any JSON object.")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [n for n in ("json_", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self


class SamplingFields(Sampling):
    """The fields completions and chat share."""

    stop: Text | list[Text] | None = Field(
        None, description=f"Up to {MAX_STOP} strings; never part of the text."
    )
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    best_of: int | None = Field(None, description="Not supported yet (only 1).")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema: the output is made to match it by a grammar."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's constraints: json, regex, choice, grammar or json_object."
    )

    @model_validator(mode="before")
    @classmethod
    def _guided_fields(cls, data: Any) -> Any:
        # vLLM's older names (guided_json, ...) for what structured_outputs now holds
        if isinstance(data, dict) and "structured_outputs" not in data:
            guided = {k.removeprefix("guided_"): data[k] for k in GUIDED if data.get(k) is not None}
            if guided:
                data = {**data, "structured_outputs": guided}
        return data

    # as OpenAI and vLLM answer both (the fields they read are declared before them)
    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, value, info):
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"must be at least n ({n})")
        return value

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
    max_tokens: int = Field(
        16, ge=0, description="0 only with echo: the prompt scored alone (its logprobs), nothing generated."
    )
    logprobs: int | None = Field(None, ge=0, le=5, description="The sampled token's logprob plus the top N.")
    echo: bool = Field(False, description="Put the prompt before the completion (with logprobs: theirs too).")
    suffix: str | None = Field(None, description="Not supported yet.")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value, handler):
        return one_of(
            handler, value, "must be a string, a list of strings, a list of token ids or a list of lists"
        )


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = Field(None, max_length=128, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none, auto (the default with tools), required (at least one call) or a named function; "
        "required and named calls are made to match the functions' schemas by a grammar.",
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply.")
    functions: list[Any] | None = Field(None, description="Not supported (use tools).")
    function_call: Any = Field(None, description="Not supported (use tool_choice).")
    reasoning_effort: Effort | None = Field(
        None, description="Passed to the chat template as reasoning_effort (GPT-OSS's: `Reasoning: low`...)."
    )
    chat_template_kwargs: JsonObject | None = Field(
        None, description='More variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).'
    )
    include_reasoning: bool = Field(True, description="false: the reasoning is left out of the reply.")
    add_generation_prompt: bool = Field(
        True, description="vLLM's: end the prompt with the opening of the assistant's turn."
    )
    continue_final_message: bool = Field(
        False,
        description="vLLM's: the last message is the start of the assistant's reply (a prefill), which the model "
        "continues; the reply holds only the new text. Implies add_generation_prompt false.",
    )

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _continue_or_open_a_turn(self):
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @field_validator("messages")
    @classmethod
    def _tool_results_follow_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        previous = None  # the message before the current run of tool results
        for m in messages:
            if m.role == "tool" and not (previous and previous.role == "assistant" and previous.tool_calls):
                raise ValueError("a 'tool' message must follow an assistant message with tool_calls")
            if m.role != "tool":
                previous = m
        return messages


# --- responses ----------------------------------------------------------------------------------


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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null in a reply of tool calls alone
    tool_calls: list[ToolCall] | None = None
    # a thinking model's reasoning, apart from its answer: vLLM's and llama.cpp's name, and vLLM's newer one
    reasoning_content: str | None = None
    reasoning: str | None = None


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


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first has its id, type and name, the next ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _omit_nulls(self, handler) -> dict[str, Any]:
        data = handler(self)
        data["function"] = {k: v for k, v in data["function"].items() if v is not None}
        return {key: value for key, value in data.items() if value is not None}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

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


# --- embeddings: a prefill-only request --------------------------------------------------------------


class EmbeddingRequest(Body):
    """OpenAI's embeddings request; `prompt_name` is sentence-transformers' (a prompt the model names)."""

    model: str | None = None
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        description=f"A text, texts, a text's token ids, or several texts' token ids; at most {MAX_POOLED_INPUTS}."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes, base64-encoded."
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        description="Keep the first N values (Matryoshka), normalised again where the model normalises.",
    )
    prompt_name: str | None = Field(
        None,
        description="Put the model's prompt of this name (config_sentence_transformers.json, e.g. Qwen3-Embedding's "
        "`query`) before each text input.",
    )
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
