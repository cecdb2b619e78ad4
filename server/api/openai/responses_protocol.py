"""The bodies of OpenAI's Responses API (/v1/responses) and its stream events, as kvserve serves it: text in and
out, function and custom tools (also grouped in namespaces), a conversation carried whole in each request or
continued from a response the server keeps (previous_response_id; openai/response_store.py).

Request bodies follow protocol.py's rules: unknown fields are ignored, null means the default, and what kvserve
cannot do (other input types, stored conversations and prompts) is refused by name. Built-in tools (web search,
file search, ...) are the exception: agents such as Codex offer them with every request, so they are left out of
the prompt, and only a tool_choice that names one is refused.
"""

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    field_validator,
    model_validator,
)

from server.api.openai.protocol import TokenLogprob
from server.api.protocol import (
    TOOL_NAME,
    Body,
    Effort,
    JsonObject,
    Sampling,
    Text,
    list_or_string,
    one_of,
    refuse_other,
)

MAX_TOOLS = 128
STATELESS = {  # fields that would need stored state kvserve does not keep, or a background job: refused
    "conversation": "kvserve keeps no conversations: send the whole conversation as input",
    "background": "kvserve does not run responses in the background",
    "prompt": "kvserve keeps no prompt templates: send the instructions and input",
}
# Tools that OpenAI runs on its side, or whose calls are items kvserve never writes (local_shell_call, ...): a
# request may offer them, they are left out of the prompt; a tool_choice naming one is refused.
BUILTIN_TOOLS = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer",
    "computer_use",
    "computer_use_preview",
    "mcp",
    "code_interpreter",
    "image_generation",
    "local_shell",
    "shell",
    "apply_patch",
    "tool_search",
    "programmatic_tool_calling",
)

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
    namespace: Text | None = Field(None, description="The namespace tool the function is in, if any.")
    arguments: Text = Field("{}", description="JSON.")


class FunctionCallOutputItem(Body):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: Text
    output: list_or_string(InputTextPart, _text_parts)


class CustomToolCallItem(Body):
    """A call of a custom tool the model made earlier: its input is text, not JSON arguments."""

    type: Literal["custom_tool_call"]
    call_id: Text
    name: Text
    namespace: Text | None = None
    input: Text


class CustomToolCallOutputItem(Body):
    type: Literal["custom_tool_call_output"]
    call_id: Text
    output: list_or_string(InputTextPart, _text_parts)


class ReasoningTextPart(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(Body):
    """The model's reasoning in an earlier turn (as the response's output gave it): rendered as the reasoning of
    the assistant turn it comes before, for templates that render it."""

    type: Literal["reasoning"]
    id: Text | None = None
    content: list[ReasoningTextPart] | None = None
    summary: list[ReasoningTextPart] = Field(default_factory=list)
    encrypted_content: Text | None = Field(None, description="Accepted; not read (kvserve encrypts nothing).")


def _user_message(text: str) -> list[dict]:
    return [{"type": "message", "role": "user", "content": text}]


InputItem = Annotated[
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME, description="Letters, digits, '_', '-' and '.', at most 64.")
    description: Text | None = None
    parameters: JsonObject | None = Field(None, description="The arguments' JSON schema.")
    strict: bool | None = Field(
        None,
        description="Forced calls match the schema; true: its keywords no grammar can enforce (uniqueItems, not, "
        "if/then/else) are a 400, otherwise ignored.",
    )


class TextInputFormat(Body):
    type: Literal["text"]


class GrammarInputFormat(Body):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: Text


class CustomTool(Body):
    """A tool whose input is free text rather than JSON arguments (Codex's freeform tools). The model is offered
    it as a function of one string argument, `input`; a format's grammar is shown to it, not enforced."""

    type: Literal["custom"]
    name: str = Field(pattern=TOOL_NAME, description="Letters, digits, '_', '-' and '.', at most 64.")
    description: Text | None = None
    format: Annotated[TextInputFormat | GrammarInputFormat, Field(discriminator="type")] = Field(
        default_factory=lambda: TextInputFormat(type="text"), description="text, or a Lark or regex grammar."
    )


def _known_type(kinds: tuple[str, ...], what: str, accepted: str):
    # said once, by name, rather than as the discriminated union's list of every tag
    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            raise ValueError(f"{what} of type {kind[:64]!r} are not supported by kvserve (only {accepted})")
        return value

    return BeforeValidator(check)


NamespacedTool = Annotated[
    FunctionTool | CustomTool,
    Field(discriminator="type"),
    _known_type(("function", "custom"), "namespaced tools", "'function' or 'custom'"),
]


class NamespaceTool(Body):
    """Function and custom tools grouped under a name. The model is offered each as `<namespace>.<name>`; its
    calls come back with the tool's own name and the namespace apart (`name`, `namespace`)."""

    type: Literal["namespace"]
    name: str = Field(pattern=TOOL_NAME, description="Letters, digits, '_', '-' and '.', at most 64.")
    description: Text | None = None
    tools: list[NamespacedTool] = Field(min_length=1, max_length=MAX_TOOLS)


class BuiltinTool(Body):
    """A tool OpenAI would run itself (web search, file search, computer use, MCP, ...): left out of the prompt,
    and named in the response's `x-kvserve-ignored-tools` header."""

    model_config = ConfigDict(extra="allow")  # echoed in the response as it came

    type: Literal[BUILTIN_TOOLS]


Tool = Annotated[
    FunctionTool | CustomTool | NamespaceTool | BuiltinTool,
    Field(discriminator="type"),
    _known_type(
        ("function", "custom", "namespace", *BUILTIN_TOOLS),
        "tools",
        "'function', 'custom', 'namespace' and built-in tools, which are left out",
    ),
]


class NamedChoice(Body):
    """The one tool to call: a function, or a custom tool."""

    type: Literal["function", "custom"]
    name: str = Field(description="The tool's name; one in a namespace tool as `<namespace>.<name>`.")
    namespace: str | None = Field(None, description="Or the namespace apart.", exclude_if=lambda v: v is None)

    def prompt_name(self) -> str:
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


class TextFormat(Body):
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, description="The schema's name (not used).")
    description: str | None = None
    schema_: JsonObject | None = Field(
        None, alias="schema", description="json_schema: the schema the output will match."
    )
    strict: bool | None = Field(
        None,
        description="true: the schema's keywords no grammar can enforce (uniqueItems, not, if/then/else) are a 400; "
        "otherwise they are ignored. Every other keyword is enforced either way.",
    )

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
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="Accepted; no effect.", exclude_if=lambda v: v is None
    )


class ReasoningConfig(Body):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = Field(
        None,
        description="Asked for (not none), the reasoning is its own summary too: kvserve has no summarizer, "
        "and clients that show only summaries (Codex) show the reasoning.",
    )
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = Field(
        None, description="The older name of summary."
    )

    @property
    def summarized(self) -> bool:
        return (self.summary or self.generate_summary or "none") != "none"


LOGPROBS = "message.output_text.logprobs"  # the include value that asks for them


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
    tools: list[Tool] = Field(
        default_factory=list,
        max_length=MAX_TOOLS,
        description="Functions and custom tools the model may call, alone or in namespaces; built-in tools "
        "(web_search, file_search, ...) are left out of the prompt.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedChoice = Field(
        "auto",
        description="none, auto, required (at least one call) or {'type': 'function' or 'custom', 'name': "
        "...}; naming a built-in tool is refused.",
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply.")
    metadata: dict[str, str] | None = Field(None, description="Echoed in the response.")
    user: str | None = None
    reasoning: ReasoningConfig | None = Field(
        None,
        description="effort: passed to the chat template as reasoning_effort; the reasoning comes as reasoning "
        "items before the answer (summary: accepted, no effect).",
    )
    chat_template_kwargs: JsonObject | None = Field(
        None, description='More variables for the chat template, e.g. {"enable_thinking": false} (Qwen3).'
    )
    include: list[str] | None = Field(
        None,
        description='"message.output_text.logprobs": each output_text part carries its tokens\' logprobs (and '
        "top_logprobs alternatives); other values are accepted, with no effect.",
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Alternatives to each token's logprob, with include's logprobs."
    )
    prompt_cache_key: str | None = Field(
        None, description="Accepted; not needed: the prefix cache finds shared prefixes by their tokens."
    )
    client_metadata: JsonObject | None = Field(None, description="Accepted; no effect.")
    store: bool = Field(
        True,
        description="Keep the response (in the server's memory, within --responses-store-memory) for "
        "previous_response_id and GET /v1/responses/{id}.",
    )
    previous_response_id: str | None = Field(
        None,
        description="Continue a stored response: its conversation (inputs and outputs, not its instructions) "
        "comes before this input.",
    )
    conversation: Any = Field(None, description="Not supported (no conversation objects are kept).")
    background: bool | None = Field(None, description="Only false.")
    prompt: Any = Field(None, description="Not supported (no stored prompt templates).")

    @property
    def logprobs(self) -> int | None:
        """How many alternatives each output token's logprob comes with; None: no logprobs."""
        if LOGPROBS in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

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
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in BUILTIN_TOOLS:
            raise ValueError(f"names the built-in tool {kind!r}: kvserve cannot run it")
        if isinstance(value, dict) and kind not in ("function", "custom"):
            kind = str(kind)[:64]
            raise ValueError(
                f"tool choices of type {kind!r} are not supported by kvserve (only 'function' or 'custom')"
            )
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
    logprobs: list[TokenLogprob] = Field(default_factory=list)  # with include's message.output_text.logprobs


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
    namespace: str | None = Field(None, exclude_if=lambda v: v is None)  # of a function in a namespace tool
    arguments: str  # JSON
    status: Status


class OutputCustomToolCall(BaseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = Field(None, exclude_if=lambda v: v is None)
    input: str
    status: Status


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class OutputReasoning(BaseModel):
    """The model's reasoning before its answer (or between its calls), as its text; its summary is the same
    text, when the request asked for one."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


OutputItem = Annotated[
    OutputMessage | OutputFunctionCall | OutputCustomToolCall | OutputReasoning, Field(discriminator="type")
]


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
    completed_at: int | None = None  # when status became completed (OpenAI's: only then)
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
    tool_choice: Literal["none", "auto", "required"] | NamedChoice
    tools: list[Tool]
    text: TextConfig
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = False
    background: Literal[False] = False
    previous_response_id: str | None = None
    truncation: Literal["disabled"] = "disabled"


ITEM_ID_PREFIXES = {  # as OpenAI's item ids begin
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
}


class InputItemList(BaseModel):
    """A stored response's input items, each with an id (`<kind>_<the response's>_<its place>`) and a status."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


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
    """A message's text part, or a reasoning item's, begins (added: empty) or ends (done: whole)."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ReasoningTextDeltaEvent(BaseModel):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningSummaryPartEvent(BaseModel):
    """A reasoning item's summary part begins (added: empty) or ends (done: whole)."""

    type: Literal["response.reasoning_summary_part.added", "response.reasoning_summary_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class ReasoningSummaryTextDeltaEvent(BaseModel):
    type: Literal["response.reasoning_summary_text.delta"] = "response.reasoning_summary_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    delta: str


class ReasoningSummaryTextDoneEvent(BaseModel):
    type: Literal["response.reasoning_summary_text.done"] = "response.reasoning_summary_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    summary_index: int
    text: str


class ReasoningTextDoneEvent(BaseModel):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class OutputTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[TokenLogprob] = Field(default_factory=list)


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


class CustomToolCallInputDeltaEvent(BaseModel):
    type: Literal["response.custom_tool_call_input.delta"] = "response.custom_tool_call_input.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class CustomToolCallInputDoneEvent(BaseModel):
    type: Literal["response.custom_tool_call_input.done"] = "response.custom_tool_call_input.done"
    sequence_number: int
    item_id: str
    output_index: int
    input: str


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
            | ReasoningTextDeltaEvent
            | ReasoningTextDoneEvent
            | ReasoningSummaryPartEvent
            | ReasoningSummaryTextDeltaEvent
            | ReasoningSummaryTextDoneEvent
            | FunctionCallArgumentsDeltaEvent
            | FunctionCallArgumentsDoneEvent
            | CustomToolCallInputDeltaEvent
            | CustomToolCallInputDoneEvent
            | ResponseErrorEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """One server-sent event of a streamed response: `event: <type>` then `data: <this JSON>`."""
