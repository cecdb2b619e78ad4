"""The bodies of Anthropic's Messages API (/v1/messages), its stream events and its errors, as kvserve serves it:
text, client tools and thinking.

Request bodies follow protocol.py's rules: unknown fields are ignored (cache_control, a tool's defer_loading, ...),
null means the default, and what kvserve cannot do (images, documents, server tools) is refused by name. The
fields Claude Code sends that have no effect here (context_management, metadata, output_config.effort)
are named in the schema, so that the server can say at debug level that it did not use them.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from server.api.errors import MAX_ERROR_CHARS, ApiError
from server.api.protocol import (
    MAX_STOP,
    TOOL_NAME,
    Body,
    JsonObject,
    Sampling,
    Text,
    list_or_string,
    refuse_other,
)

MAX_TOOLS = 128
# Anthropic's error type for each status; any other is an api_error
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


def _text_blocks(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


# --- the request ------------------------------------------------------------------------------------


class TextBlock(Body):
    type: Literal["text"] = "text"
    text: Text


class TextOnly(Body):
    """A text block where only text may be: the system prompt, a tool's result."""

    type: refuse_other(("text",), "content blocks")
    text: Text


class ToolUseBlock(Body):
    """A call of a tool: the model's, in an assistant message or the reply."""

    type: Literal["tool_use"] = "tool_use"
    id: Text
    name: Text
    input: JsonObject = Field(default_factory=dict)


class ToolResultBlock(Body):
    """What a call returned, in the user message after it."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: list_or_string(TextOnly, _text_blocks) = Field(default_factory=list)
    is_error: bool = False


class ThinkingBlock(Body):
    """The model's reasoning before its answer: in the reply, and in an assistant message (history)."""

    type: Literal["thinking"] = "thinking"
    thinking: Text
    signature: str = Field("", description="Opaque; kvserve's is a digest of the thinking, not checked.")


class RedactedThinkingBlock(Body):
    """Anthropic's encrypted thinking (history): accepted, and left out of the prompt (nothing can read it)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(Body):
    role: Literal["user", "assistant", "system"] = Field(
        description="system: instructions in the middle of the conversation (Claude Code sends them), text only."
    )
    content: list_or_string(ContentBlock, _text_blocks)


class Tool(Body):
    type: refuse_other(("custom",), "tools") = "custom"
    name: str = Field(pattern=TOOL_NAME, description="Letters, digits, '_', '-' and '.', at most 64.")
    description: Text | None = None
    input_schema: JsonObject = Field(description="The input's JSON schema.")
    strict: bool | None = Field(
        None,
        description="Forced calls match the schema; true: its keywords no grammar can enforce (uniqueItems, not, "
        "if/then/else) are a 400, otherwise ignored.",
    )


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="type tool: the tool to call.")
    disable_parallel_tool_use: bool = Field(False, description="true: at most one call per reply.")

    @model_validator(mode="after")
    def _name_given(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only then")
        return self


class OutputFormat(Body):
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema", description="The schema the output will match.")


class OutputConfig(Body):
    format: OutputFormat | None = Field(None, description="The reply is JSON matching the schema.")
    effort: str | None = Field(
        None, description="Accepted, not used: the models served have no effort setting."
    )


class Thinking(Body):
    """Extended thinking: a thinking model's reasoning comes as thinking blocks before the answer. Left out or
    disabled, the chat template is asked for none (enable_thinking false, for the models that can leave it
    out) and whatever reasoning comes is not shown."""

    type: Literal["enabled", "adaptive", "disabled"] = Field(
        description="enabled (with budget_tokens) or adaptive: thinking blocks; disabled: none."
    )
    budget_tokens: int | None = Field(
        None,
        description="enabled: at most this many tokens of thinking (at least 1024); the thinking is then "
        "closed and the answer follows. max_tokens bounds the thinking and the answer together.",
    )
    display: Literal["summarized", "omitted"] | None = Field(
        None, description="omitted: thinking blocks come with their signature and no text."
    )

    @model_validator(mode="after")
    def _budget_given(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required with type 'enabled'")
        return self


class MessagesRequest(Sampling):
    max_tokens: int = Field(ge=1, description="At most the rest of the context is generated.")
    messages: list[Message] = Field(min_length=1)
    system: list_or_string(TextOnly, _text_blocks) = Field(
        default_factory=list, description="A string or text blocks."
    )
    stop_sequences: list[Text] = Field(default_factory=list, max_length=MAX_STOP)
    tools: list[Tool] = Field(default_factory=list, max_length=MAX_TOOLS, description="Client tools.")
    tool_choice: ToolChoice = Field(
        default_factory=lambda: ToolChoice(type="auto"),
        description="auto, any (at least one call), tool (that one) or none; any and tool are made to match "
        "the tools' schemas by a grammar.",
    )
    output_config: OutputConfig | None = None
    thinking: Thinking | None = Field(
        None, description="Thinking blocks before the answer (a thinking model's)."
    )
    context_management: JsonObject | None = Field(
        None,
        description="Accepted, not used: there are no thinking blocks or tool results kept here to clear.",
    )
    metadata: JsonObject | None = Field(None, description="Accepted, not used.")

    def stop_list(self) -> list[str]:
        return list(self.stop_sequences)

    def unused_fields(self) -> list[str]:
        """The fields given that kvserve accepts and does not act on."""
        given = [name for name in ("context_management", "metadata") if getattr(self, name) is not None]
        if self.output_config is not None and self.output_config.effort is not None:
            given.append("output_config.effort")
        return given


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = Field(None, description="Not used.")


class TokenCount(BaseModel):
    input_tokens: int


# --- the response -----------------------------------------------------------------------------------


class MessageUsage(BaseModel):
    input_tokens: int  # of the prompt, those not read from the cache (Anthropic counts the two apart)
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # of the prompt, those found in the prefix cache


OutputBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None  # the stop sequence that ended it
    usage: MessageUsage


class ErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error on /v1/messages, as a body or as a stream's error event."""

    type: Literal["error"] = "error"
    error: ErrorDetail


def error_body(error: ApiError) -> AnthropicError:
    """Anthropic's shape of an error, on /v1/messages and the paths below it."""
    message = error.message[:MAX_ERROR_CHARS]  # bounded, whatever the input it quotes
    return AnthropicError(error=ErrorDetail(type=ERROR_TYPES.get(error.status, "api_error"), message=message))


# --- the stream -------------------------------------------------------------------------------------
# Each event's type is also the SSE event's name.


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse  # with no content yet


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock  # empty: text "", tool input {}


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str  # the next piece of the tool input's JSON


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str  # a thinking block's, sent just before the block stops


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta, Field(discriminator="type")]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageUsage  # the totals


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class MessageStreamEvent(
    RootModel[
        Annotated[
            MessageStartEvent
            | ContentBlockStartEvent
            | ContentBlockDeltaEvent
            | ContentBlockStopEvent
            | MessageDeltaEvent
            | MessageStopEvent
            | AnthropicError,
            Field(discriminator="type"),
        ]
    ]
):
    """One server-sent event of a streamed message: `event: <type>` then `data: <this JSON>`."""
