"""Speculative drafts: guesses of the tokens that follow a request's last one, verified in its next decode.

A decode with k drafts computes its last token plus the k drafts in one chunk, and the step draws a token after
each of the k + 1 positions exactly as k + 1 plain decodes would (the kernels are batch- and chunk-invariant, the
draw is a pure function of (seed, position, token id), and each row sees the penalties, bans and grammar of
the output as it would stand there). The output stage keeps the draws up to the first that differs from its
draft, so a draft costs compute but never changes a bit of the output.

Two sources, both free to propose:
- n-gram (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last n
  tokens, n from prompt_lookup_max down to prompt_lookup_min. Copy-heavy work (edits of a given file, answers
  quoting their sources) repeats long runs of its prompt.
- grammar fast-forward: where the request's grammar allows one continuation only (a JSON key, a tool call's
  fixed fields), those tokens.

Drafts cost where they are rejected, so each request adapts: after a verify it proposes one more than it had
accepted (up to num_speculative_tokens), and after a verify that accepted nothing it waits 1, 2, 4 ... steps
before proposing again (reset by the next acceptance). And each step adapts: its decodes plus their drafts stay
within SpeculativeConfig.max_step_rows, the rows its GEMMs compute at about the cost of one (a one-row GEMM waits
on memory, a many-row one on arithmetic, where every draft costs what a decode does). The requests whose latest
verifies kept the most draft first; a step with that many decodes drafts nothing.
"""

from collections import Counter
from dataclasses import dataclass, field

from server.engine.config import SpeculativeConfig
from server.engine.request import FinishReason
from server.engine.request_state import Request
from server.engine.scheduler import ScheduledChunk

MAX_BACKOFF = 64  # steps a request may wait before drafting again


@dataclass(slots=True)
class _Drafts:
    """One request's n-gram index and its adaptive draft length."""

    # an n-gram -> the position right after its latest occurrence that has a token after it
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending before this position are in the index
    max_drafts: int = 0
    wait: int = 0  # steps to skip before drafting again
    backoff: int = 1  # the next wait after a verify that accepted nothing


def accepted_drafts(drafts: list[int], emitted: list[int]) -> int:
    """How many drafts the step's draws confirmed: the length of their common prefix."""
    n = 0
    for d, e in zip(drafts, emitted, strict=False):
        if d != e:
            break
        n += 1
    return n


class Drafter:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._states: dict[str, _Drafts] = {}
        # decodes verified with drafts, their drafts, the drafts kept, kept drafts by position (0 = first)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position: Counter[int] = Counter()

    def after_step(
        self,
        chunks: list[ScheduledChunk],
        kept: dict[str, list[int]],
        finished: dict[str, FinishReason],
        running: list[Request],
    ) -> None:
        """Learn what the step's verifies kept, then draft for the next step."""
        for c in chunks:
            if c.drafts:
                self._record(c.request, c.drafts, kept.get(c.request.request_id, []))
        for request_id in finished:
            self.forget(request_id)
        for request in running:
            request.draft_token_ids = []
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        room = self.config.max_step_rows - len(decoding)
        # sorted is stable: ties keep their running order
        for request in sorted(decoding, key=self._draft_length, reverse=True):
            if room <= 0:
                break
            request.draft_token_ids = self._propose(request, room)
            room -= len(request.draft_token_ids)

    def _draft_length(self, request: Request) -> int:
        state = self._states.get(request.request_id)
        return self.config.num_speculative_tokens if state is None else state.max_drafts

    def _record(self, request: Request, drafts: list[int], kept: list[int]) -> None:
        num_accepted = accepted_drafts(drafts, kept)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        self._adapt(request, num_accepted)

    def _adapt(self, request: Request, num_accepted: int) -> None:
        """The request's next draft length and wait, from what its latest verify accepted."""
        state = self._states.get(request.request_id)
        if state is None:
            return
        state.max_drafts = min(self.config.num_speculative_tokens, num_accepted + 1)
        if num_accepted == 0:
            state.wait, state.backoff = state.backoff, min(2 * state.backoff, MAX_BACKOFF)
        else:
            state.backoff = 1

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose(self, request: Request, room: int) -> list[int]:
        """Up to `room` drafts for a decode (fewer after misses, none while it waits)."""
        if not request.params.speculative:
            return []
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _Drafts(max_drafts=self.config.num_speculative_tokens)
        # the output may not outgrow max_tokens: a draft past it could never be kept
        k = min(state.max_drafts, room, request.params.max_tokens - len(request.output_token_ids) - 1)
        if k <= 0:
            return []
        if request.grammar is not None:
            forced = request.grammar.forced_tokens()[:k]
            if forced:
                return forced
        if state.wait > 0:
            state.wait -= 1
            return []
        drafts = self._lookup(request, state, k)
        if drafts and request.grammar is not None:  # the grammar must allow them: a mask needs a valid past
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def _lookup(self, request: Request, state: _Drafts, k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix (of the allowed lengths)
        that occurred before."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        length = request.num_tokens
        # index every n-gram that ends at least one token before the last: each has a token after it
        for end in range(max(state.num_indexed, lo), length):
            window = request.token_slice(max(end - hi, 0), end)
            for n in range(lo, min(hi, len(window)) + 1):
                state.index[tuple(window[-n:])] = end
        state.num_indexed = length
        suffix = request.token_slice(max(length - hi, 0), length)
        for n in range(min(hi, len(suffix)), lo - 1, -1):
            # < length: only n-grams before the suffix are indexed
            after = state.index.get(tuple(suffix[-n:]))
            if after is not None:
                return request.token_slice(after, min(after + k, length))
        return []
