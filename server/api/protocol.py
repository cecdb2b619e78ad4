"""What every API's bodies are made of (OpenAI's chat and completions, OpenAI's Responses, Anthropic's
Messages): the request base and its rules, the validated types, the helpers that shape fields and their errors,
the sampling fields they all take, and the usage the serving pipeline counts.

Unknown request fields are ignored (clients send extras); fields kvserve knows but does not support are
rejected by name, so a client never silently gets behaviour it did not ask for. A JSON null means "the
default", as in OpenAI's API.
"""

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

MAX_STOP = 16
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


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
MAX_JSON_DEPTH = 64  # JSON schemas and tool arguments (grammars refuse deeper ones anyway)


def _bounded_depth(value: Any) -> Any:
    # Counted without recursion: a body nested ~1000 deep parses, and would then overflow Python's stack in
    # whatever walks it next (json.dumps).
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"is nested deeper than {MAX_JSON_DEPTH} levels")
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
    # Pydantic reports a failed union once per member ("prompt.str", "prompt.list[int]", ...); say it once.
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(message) from None


class Sampling(Body):
    """The sampling fields every generating endpoint takes: OpenAI's names, and vLLM's for what OpenAI's lack."""

    model: str | None = Field(None, description="The served model name; may be left out.")
    temperature: float = Field(1.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off.")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    speculative: bool = Field(
        True,
        description="false: no speculative drafts for this request (the server drafts by default on CPU, and "
        "as --speculative-config says). The output is the same either way; drafts only change its speed.",
    )
    logit_bias: dict[int, float] | None = Field(
        None, description="Token id (as a string) -> a bias in [-100, 100] added to its logit; at most 300."
    )

    def stop_list(self) -> list[str]:
        return []


# --- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


# What a request used, as the serving pipeline counts it: OpenAI's shape, which chat and completions send as it
# is and the other APIs reshape (a docstring here would be a description in openapi.yaml).
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
