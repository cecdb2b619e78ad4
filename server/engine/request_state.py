"""The engine's own record of a request: where it stands (waiting, running, its computed tokens, its blocks,
its grammar state). Callers never see it: they get RequestOutputs (server/engine/request.py)."""

import enum
import time
from dataclasses import dataclass, field

from server.engine.grammar import GrammarState
from server.engine.reasoning import ReasoningState
from server.engine.request import FinishReason, Pooling, PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # tokens drawn for it by scheduled steps whose draws the host has not read yet: the step being scheduled, and
    # under async scheduling (engine.py) the one still running on the device; they count in num_tokens
    num_pending_tokens: int = 0
    # prompt + output tokens whose K/V are in the cache; catches up with num_tokens
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    # one per KV group of the cache (block_manager.py), while it holds blocks
    block_tables: list[list[int]] = field(default_factory=list)
    # a hybrid model's state slot (its Gated DeltaNet layers' recurrent state), held while it runs
    state_slot: int | None = None
    # a hybrid's: its first tokens whose K/V the prefix cache held at admission past the state it resumed from,
    # a prefix other requests share: its state is kept (snapshot) when its prefill gets there
    num_shared_prefix_tokens: int = 0
    finish_reason: FinishReason | None = None
    grammar: GrammarState | None = None  # where its output is in params.grammar; dropped when it finishes
    # where its output is against its reasoning (params.reasoning), until that ends: then its grammar moves here
    reasoning: ReasoningState | None = None
    num_preemptions: int = 0
    scheduled_time: float | None = None  # time.monotonic() of its first admission, for metrics
    # tokens guessed to follow its last one (drafting.py), verified in its next decode; never part of the output
    # until the step's draw agrees with them
    draft_token_ids: list[int] = field(default_factory=list)
    # a prefill-only request (embeddings, scores): pooled after its prompt, finished without drawing a token
    pooling: PoolingParams | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Its output's length once the draws of its scheduled steps are read."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def next_draw_reads_output(self) -> bool:
        """Whether its next draw depends on which tokens it drew, not only on how many: penalties count them, a
        grammar masks by them, and so may its reasoning's phase. Its step is read back before the next is
        scheduled (engine.py)."""
        p = self.params
        penalties = p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
        steered = self.reasoning is not None and self.reasoning.steers_draws
        return penalties or self.grammar is not None or steered

    @property
    def reads_every_position(self) -> bool:
        """Whether every prompt position must be computed, none served from the prefix cache: prompt logprobs
        score each one, mean and CLS pooling read their hidden states (a cached block holds K/V, not those)."""
        pooling = self.pooling.pooling if self.pooling is not None else None
        return self.params.prompt_logprobs or pooling in (Pooling.MEAN, Pooling.CLS)

    @property
    def constraint(self) -> GrammarState | ReasoningState | None:
        """What masks its next draw: its grammar, or its reasoning's phase where that decides; None: nothing."""
        if self.grammar is not None:
            return self.grammar
        return self.reasoning if self.reasoning is not None and self.reasoning.masks else None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
