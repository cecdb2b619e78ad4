"""The bodies of OpenAI's Responses API (/v1/responses) and its stream events, as kvserve serves it: stateless
(nothing is stored, so every request carries its whole conversation), text in and out, and function tools.

Request bodies follow protocol.py's rules: unknown fields are ignored, null means the default, and what kvserve
cannot do (other tool and input types, stored state) is refused by name.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, field_validator, model_validator

from server.api.protocol import (
    TOOL_NAME,
    Body,
    JsonObject,
    Sampling,
    Text,
    list_or_string,
    one_of,
    refuse_other,
)

MAX_TOOLS = 128
STATELESS = {  # fields that would need a stored response or a background job; any value given is refused
    "store": "kvserve keeps no responses: send store: false (or leave it out)",
    "previous_response_id": "kvserve keeps no responses: send the whole conversation as input",
    "conversation": "kvserve keeps no conversations: send the whole conversation as input",
    "background": "kvserve does not run responses in the background",
    "prompt": "kvserve keeps no prompt templates: send the instructions and input",
}

# --- the request ------------------------------------------------------------------------------------


class InputTextPart(Body):
    type: refuse_other(("input_text", "output_text"), "content parts")
    text: Text


def _text_parts(text: str) -> list[dict]:
    return [{"type": "input_text", "text": text}]


class MessageItem(Body):
    """A message of the conversation: its role and its text."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list_or_string(InputTextPart, _text_parts)


class FunctionCallItem(Body):
    """A call the model made earlier (as the response's output gave it)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field("{}", description="JSON.")


class FunctionCallOutputItem(Body):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: Text
    output: list_or_string(InputTextPart, _text_parts)


def _user_message(text: str) -> list[dict]:
    return [{"type": "message", "role": "user", "content": text}]


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class FunctionTool(Body):
    type: refuse_other(("function",), "tools")
    name: str = Field(pattern=TOOL_NAME, description="Letters, digits, '_', '-' and '.', at most 64.")
    description: Text | None = None
    parameters: JsonObject | None = Field(None, description="The arguments' JSON schema.")
    strict: bool | None = Field(None, description="Forced calls always match the schema, strict or not.")


class FunctionChoice(Body):
    type: refuse_other(("function",), "tool choices")
    name: str


class TextFormat(Body):
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, description="The schema's name (not used).")
    description: str | None = None
    schema_: JsonObject | None = Field(
        None, alias="schema", description="json_schema: the schema the output will match."
    )
    strict: bool | None = Field(None, description="Outputs always match the schema, strict or not.")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required when type is 'json_schema'")
        return self

    def output_schema(self) -> dict | None:
        """The JSON schema the output must match, or None for free text."""
        if self.type == "text":
            return None
        return self.schema_ if self.type == "json_schema" else {"type": "object"}


class TextConfig(Body):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ResponsesRequest(Sampling):
    input: list_or_string(InputItem, _user_message) = Field(
        min_length=1,
        description="A string (one user message), or the conversation as input items: messages, function "
        "calls and their outputs.",
    )
    instructions: Text | None = Field(None, description="The system message.")
    max_output_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    text: TextConfig = Field(
        default_factory=TextConfig, description="format: text, json_object or json_schema."
    )
    tools: list[FunctionTool] = Field(
        default_factory=list, max_length=MAX_TOOLS, description="Functions the model may call."
    )
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = Field(
        "auto", description="none, auto, required (at least one call) or {'type': 'function', 'name': ...}."
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply.")
    metadata: dict[str, str] | None = Field(None, description="Echoed in the response.")
    user: str | None = None
    store: bool | None = Field(None, description="Only false: kvserve keeps no responses.")
    previous_response_id: str | None = Field(None, description="Not supported (nothing is stored).")
    conversation: Any = Field(None, description="Not supported (nothing is stored).")
    background: bool | None = Field(None, description="Only false.")
    prompt: Any = Field(None, description="Not supported (no stored prompt templates).")

    @field_validator("input", mode="before")
    @classmethod
    def _messages_untyped(cls, value: Any) -> Any:
        # a message may leave out its type (OpenAI's "easy input message")
        if isinstance(value, list):
            return [{"type": "message", **v} if isinstance(v, dict) and "type" not in v else v for v in value]
        return value

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _check_tool_choice(cls, value, handler):
        if isinstance(value, dict) and value.get("type") != "function":
            kind = str(value.get("type"))[:64]
            raise ValueError(f"tool choices of type {kind!r} are not supported by kvserve (only 'function')")
        return one_of(
            handler, value, "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}"
        )

    @field_validator(*STATELESS)
    @classmethod
    def _refuse_state(cls, value, info):
        if value is not False:
            raise ValueError(STATELESS[info.field_name])
        return value


# --- the response -----------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


Status = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON
    status: Status


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # of the input tokens, those found in the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    text: TextConfig
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: Literal[False] = False
    background: Literal[False] = False
    previous_response_id: None = None
    truncation: Literal["disabled"] = "disabled"


# --- the stream -------------------------------------------------------------------------------------
# Each event carries its place in the stream (sequence_number); its type is also the SSE event's name.


class ResponseLifecycleEvent(BaseModel):
    """The response as it stands: at the start (created, in_progress) and at the end (completed, incomplete or
    failed: the whole response)."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    """An output item begins (added: as it stands) or ends (done: whole)."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    """A message's text part begins (added: empty) or ends (done: whole)."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(BaseModel):
    """The stream failed after it started."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None


class ResponseStreamEvent(
    RootModel[
        Annotated[
            ResponseLifecycleEvent
            | OutputItemEvent
            | ContentPartEvent
            | OutputTextDeltaEvent
            | OutputTextDoneEvent
            | FunctionCallArgumentsDeltaEvent
            | FunctionCallArgumentsDoneEvent
            | ResponseErrorEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """One server-sent event of a streamed response: `event: <type>` then `data: <this JSON>`."""
