"""What every API's bodies are made of (OpenAI's chat and completions, OpenAI's Responses, Anthropic's
Messages): the request base and its rules, the validated types, the helpers that shape fields and their errors,
the sampling fields they all take, and the usage the serving pipeline counts. And the server's own bodies, which
belong to no one API: chat messages (as /tokenize takes them too), health, models, tokens, errors (in OpenAI's
shape, which vLLM's clients read too), rerank and score.

Unknown request fields are ignored (clients send extras); fields kvserve knows but does not support are
rejected by name, so a client never silently gets behaviour it did not ask for. A JSON null means "the
default", as in OpenAI's API; a value of another JSON type is refused, never converted.
"""

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from server.api.errors import MAX_ERROR_CHARS, ApiError

MAX_STOP = 16
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class Body(BaseModel):
    # strict: a value of the wrong JSON type is refused, as OpenAI's and Anthropic's APIs refuse it, rather than
    # read as something the client did not write ("max_tokens": true is not 1, "stream": "false" is not false).
    # NaN and infinities (Python's JSON reads them) are refused as what they are, before any range check
    # ("temperature": NaN is not "less than 0")
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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
MAX_JSON_DEPTH = 64  # JSON schemas and tool arguments (grammars refuse deeper ones anyway)


def _bounded_depth(value: Any) -> Any:
    # Counted without recursion: a body nested ~1000 deep parses, and would then overflow Python's stack in
    # whatever walks it next (json.dumps).
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(
                f"is nested deeper than {MAX_JSON_DEPTH} levels of JSON objects and arrays (in a schema, each object"
                " property nested takes two: `properties` and the property's schema)"
            )
        children = item.values() if isinstance(item, dict) else item
        # Only containers go on the stack: a 200,000-string enum is one filtered pass, not 200,000 pops.
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_depth)]  # a JSON schema, tool arguments


def list_or_string(item: Any, from_string: Callable[[str], list]) -> Any:
    """A list of `item`, or a string that stands for the list from_string() makes of it (one text part). Parsed
    as the list, so that an error names the part at fault rather than each member of a union."""

    def as_list(value: Any) -> Any:
        return from_string(value) if isinstance(value, str) else value

    def documented(schema: dict) -> None:
        kept = {k: schema.pop(k) for k in ("title", "description") if k in schema}
        as_array = dict(schema)
        schema.clear()
        schema.update(kept, anyOf=[{"type": "string"}, as_array])

    return Annotated[list[item], BeforeValidator(as_list), Field(json_schema_extra=documented)]


def refuse_other(kinds: tuple[str, ...], what: str) -> Any:
    """A `type` field of one of `kinds`; any other value is refused with a message naming it."""

    def check(value: Any) -> Any:
        if isinstance(value, str) and value not in kinds:
            accepted = " or ".join(repr(k) for k in kinds)
            raise ValueError(f"{what} of type {value[:64]!r} are not supported by kvserve (only {accepted})")
        return value

    return Annotated[Literal[kinds], BeforeValidator(check)]


def one_of(handler, value: Any, message: str) -> Any:
    # Pydantic reports a failed union once per member ("prompt.str", "prompt.list[int]", ...); say it once. A
    # value of the right kind that a member's own check refused (a string with a lone surrogate) says why instead:
    # only the member of the value's kind gets as far as running its checks.
    try:
        return handler(value)
    except ValidationError as e:
        why = [err["msg"].removeprefix("Value error, ") for err in e.errors() if err["type"] == "value_error"]
        raise ValueError(why[0] if why else message) from None


Effort = Literal["none", "minimal", "low", "medium", "high"]


class Sampling(Body):
    """The sampling fields every generating endpoint takes: OpenAI's names, and vLLM's for what OpenAI's lack."""

    model: str | None = Field(None, description="The served model name; may be left out.")
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    # 0, which OpenAI's API takes, keeps the most likely token alone (apply_top_k_top_p keeps at least one)
    top_p: float = Field(1.0, ge=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off.")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(
        False, description="vLLM's: the stop string that ended the output stays at its end."
    )
    min_tokens: int = Field(0, ge=0)
    speculative: bool = Field(
        True,
        description="false: no speculative drafts for this request (the server drafts by default on CPU, and "
        "as --speculative-config says). The output is the same either way; drafts only change its speed.",
    )
    # JSON's keys are strings: a token id's may be read as the number it spells
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit; at most 300."
    )

    def stop_list(self) -> list[str]:
        return []


# --- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens: the reasoning's, markers included


# What a request used, as the serving pipeline counts it: OpenAI's shape, which chat and completions send as it
# is and the other APIs reshape (a docstring here would be a description in openapi.yaml).
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


# --- a conversation in OpenAI's chat shape: chat's messages and /tokenize's ---------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class FunctionCallIn(Body):
    name: Text
    arguments: Text | JsonObject = Field("{}", description="The arguments as a JSON string (or object).")


class ToolCallIn(Body):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Body):
    # "developer" is OpenAI's newer name for "system"; the chat template sees "system"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = Field(
        None, description="Required, except in an assistant message with tool_calls."
    )
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant's calls (history).")
    tool_call_id: Text | None = Field(None, description="A tool message's call.")
    reasoning_content: Text | None = Field(
        None, description="An assistant's reasoning (history), for templates that render it."
    )
    refusal: Text | None = Field(
        None,
        description="An assistant's refusal (history, as OpenAI's replies carry it): its text, where content is null.",
    )

    @model_validator(mode="before")
    @classmethod
    def _refusal_is_text(cls, data: Any) -> Any:
        # OpenAI's replies may carry a refusal instead of content, and clients send their history back as it came
        if not isinstance(data, dict) or data.get("role") != "assistant":
            return data
        content = data.get("content")
        if isinstance(content, list):
            refused = [isinstance(p, dict) and p.get("type") == "refusal" and "refusal" in p for p in content]
            content = [
                {"type": "text", "text": p["refusal"]} if r else p
                for p, r in zip(content, refused, strict=True)
            ]
        elif content is None and isinstance(data.get("refusal"), str):
            content = data["refusal"]
        return {**data, "content": content}

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_content(cls, value, handler):
        return one_of(
            handler, value, "must be a string or a list of text parts ({'type': 'text', 'text': ...})"
        )

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content is required (only an assistant message with tool_calls may leave it out)"
            )
        return self


class FunctionDefinition(Body):
    name: str = Field(pattern=TOOL_NAME, description="Letters, digits, '_', '-' and '.', at most 64.")
    description: Text | None = None
    parameters: JsonObject | None = Field(None, description="The arguments' JSON schema.")
    strict: bool | None = Field(
        None,
        description="Forced calls match the schema; true: its keywords no grammar can enforce (uniqueItems, not, "
        "if/then/else) are a 400, otherwise ignored.",
    )


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDefinition


# --- the server's own bodies: health, models, tokens, errors ------------------------------------


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
    tools: list[ChatTool] | None = Field(
        None, description="For messages: the tools offered, in the prompt as /v1/chat/completions puts them."
    )
    add_special_tokens: bool = Field(
        True, description="For a prompt: add the tokenizer's BOS/EOS if it has them."
    )
    add_generation_prompt: bool = Field(
        True, description="For messages: end with the assistant's turn opening."
    )
    continue_final_message: bool = Field(
        False, description="For messages: the last is an assistant reply's start, left open (a prefill)."
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


def error_body(error: ApiError) -> ErrorResponse:
    """OpenAI's shape of an error: the server's own, on every path no other API registers."""
    message = error.message[:MAX_ERROR_CHARS]  # bounded, whatever the input it quotes
    info = ErrorInfo(message=message, type=error.type, param=error.param, code=error.code)
    return ErrorResponse(error=info)


# --- prefill-only requests: rerank and score, and what embeddings share with them ---------------

MAX_POOLED_INPUTS = 2048  # inputs of one /v1/embeddings request (OpenAI's limit), documents of one rerank


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankDocument(Body):
    text: Text


class RerankRequest(Body):
    """Jina's and Cohere's rerank request, as vLLM and llama.cpp take it; `instruction` is Qwen3-Reranker's."""

    model: str | None = None
    query: Text
    documents: list[Text | RerankDocument] = Field(description=f"At most {MAX_POOLED_INPUTS}.")
    top_n: int | None = Field(None, ge=0, description="The best N results; left out or 0: every document.")
    return_documents: bool = Field(True, description="Each result also holds its document's text.")
    instruction: Text | None = Field(
        None, description="The reranker's task instruction (default: its model card's, for web search)."
    )

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(Body):
    """vLLM's /v1/score: each text_2 scored against text_1 (one text, or one per text_2)."""

    model: str | None = None
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    instruction: Text | None = Field(
        None, description="The reranker's task instruction (default: its model card's, for web search)."
    )

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) pairs: one text_1 goes with every text_2, else they pair up in order."""
        queries = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents):
            raise ApiError(
                400, f"text_1 has {len(queries)} texts and text_2 {len(documents)}: give one text_1, or one each",
                param="text_1",
            )  # fmt: skip
        return list(zip(queries, documents, strict=True))


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage
