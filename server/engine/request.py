"""The engine's contract: what a caller (the API, the CLI, a benchmark) hands the engine and gets back.

Only this module, config.py, stats.py and the async engine are for callers to import; the engine's own
per-request state is in request_state.py.
"""

import enum
import math
from dataclasses import dataclass, field
from typing import Protocol

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows


@dataclass(frozen=True)
class GrammarSpec:
    """What structure a request's output must have; AsyncEngine.compile_grammar() turns it into a grammar."""

    # json_schema | regex | choice (a JSON list of strings) | grammar (GBNF or Lark) | tool_calls (a JSON object:
    # calls, each a JSON schema, between `open` and `close`, one or `many` joined by `separator`, or the JSON of
    # `or_json` when that schema is given)
    kind: str
    source: str
    # JSON schemas' keywords that cannot be enforced while sampling (uniqueItems, not, if/then/else) are ignored,
    # not refused: for schemas the client did not mark strict, as OpenAI constrains those not at all
    lenient: bool = False


class Grammar(Protocol):
    """A compiled grammar, as AsyncEngine.compile_grammar() returns it (server/engine/grammar.py): opaque to
    callers, who only pass it on in SamplingParams.grammar."""

    spec: GrammarSpec


@dataclass(frozen=True)
class ReasoningSpec:
    """A thinking model's reasoning, which comes before its answer in the output, as the engine needs to know it:
    where it ends (a grammar constrains only what follows: the answer), and a budget that bounds it. The ids come
    from the caller's reasoning parser (server/api/reasoning.py)."""

    end: tuple[
        int, ...
    ]  # the tokens, in a row, that end it (`</think>`; harmony's `<|channel|>final<|message|>`)
    # None: the output starts inside the reasoning (the prompt opened it); an id (`<think>`): the output reasons
    # only if its first token is that one (the chat template left it to the model)
    opens_with: int | None = None
    budget: int | None = None  # at most this many tokens of reasoning, then `close` is forced
    close: tuple[int, ...] = ()  # what the budget forces when it runs out; ends with `end`

    def validate(self, vocab_size: int | None) -> None:
        ids = [*self.end, *self.close, *([self.opens_with] if self.opens_with is not None else [])]
        if not self.end:
            raise ParamError("reasoning", "reasoning.end must hold at least one token id")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise ParamError("reasoning", f"reasoning token ids must be in [0, {vocab_size})")
        if self.budget is not None:
            if self.budget < 1:
                raise ParamError("reasoning", f"the reasoning budget must be at least 1, got {self.budget}")
            if self.close[-len(self.end) :] != self.end:
                raise ParamError(
                    "reasoning", "a reasoning budget needs a close that ends with its end tokens"
                )


# ParamError's code for a request longer than the context, as OpenAI's API and vLLM name it: clients read it to
# shorten the conversation
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ParamError(ValueError):
    """A request the engine can never serve, blamed on one of its parameters: each API dialect names that
    parameter in its own words (the engine's `prompt` is chat's `messages`)."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client gone, shutdown, or an error


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 (or -1) = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None = off; N = the chosen token's logprob plus the top N
    prompt_logprobs: bool = False  # also the logprob of each prompt token (completions' echo)
    include_stop_str_in_output: bool = False
    # token id -> added to its logit, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # the output must match it (its end may end the output); from AsyncEngine.compile_grammar()
    grammar: Grammar | None = None
    speculative: bool = True  # False: never draft for this request, where the engine speculates
    # a thinking model's reasoning: the grammar waits for its end, the budget bounds it (None: no reasoning to
    # wait for; the grammar, if any, starts at the first token)
    reasoning: ReasoningSpec | None = None
    # token ids (a reasoning parser's markers: `<think>`, harmony's `<|channel|>` ...) left out of the text, each
    # output saying where in its text they fell (RequestOutput.marks), so that the caller splits the text by ids
    marker_token_ids: frozenset[int] = frozenset()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ParamError naming the offending field; the API maps it to a 400."""

        def bad(name: str, why: str) -> None:
            raise ParamError(name, f"{name} {why}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                bad(name, "must be a finite number")
        if self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            bad("top_p", f"must be in [0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            bad("stop", "strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", "must be a signed 64-bit integer, in [-2**63, 2**63)")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.logit_bias):
            bad("logit_bias", f"keys must be token ids in [0, {vocab_size})")
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):  # NaN fails too
            bad("logit_bias", "values must be in [-100, 100]")
        if self.reasoning is not None:
            self.reasoning.validate(vocab_size)


class Pooling(enum.Enum):
    """Which positions' final hidden states (the last norm's output, before the LM head) make a vector."""

    LAST = "last"  # the last token's (Qwen3-Embedding's: in a causal model only it has seen every token)
    MEAN = "mean"  # the mean over every position
    CLS = "cls"  # the first token's


@dataclass(frozen=True)
class PoolingParams:
    """A prefill-only request: its prompt runs through the model once, nothing is drawn, and its one output
    carries a vector (RequestOutput.pooled)."""

    pooling: Pooling = Pooling.LAST
    # given: the vector is these tokens' logits at the last position (a reranker's [no, yes]), not hidden states
    logit_token_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int | None = None) -> None:
        if self.logit_token_ids and self.pooling is not Pooling.LAST:
            raise ParamError("pooling", "logits are read at the last position only")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.logit_token_ids):
            raise ParamError("logit_token_ids", f"must be token ids in [0, {vocab_size})")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top N (token id, logprob), most likely first


@dataclass(slots=True)
class RequestTimes:
    """time.monotonic() stamps of one request, sent with its final output."""

    arrival: float
    scheduled: float | None
    first_token: float | None
    finish: float | None


@dataclass(slots=True)
class RequestError:
    """Why the engine ended a request before it finished: the request's own input failed (its grammar ran out
    of llguidance's per-token budget midway: the client's to fix) or the engine did (a bug, out of memory)."""

    message: str
    by_request: bool = False


@dataclass(slots=True)
class RequestOutput:
    """One delta for one request: what is new since the previous output."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the text delta, UTF-8 safe, stop strings never included
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, in total
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in the first output only; the first is None
    error: RequestError | None = None  # with finish_reason ABORT: the engine ended the request early
    times: RequestTimes | None = None  # on the final output only
    stop_string: str | None = None  # the stop string that ended the output, on the final output
    # (offset in `text`, token id) of each of SamplingParams.marker_token_ids among new_token_ids, in order: the
    # text before the offset came before that token (its held-back text was released at it), the rest after
    marks: list[tuple[int, int]] = field(default_factory=list)
    # a PoolingParams request's vector, float32 values, on its one (final) output: the pooled hidden state, or
    # the logits it asked for
    pooled: list[float] | None = None
