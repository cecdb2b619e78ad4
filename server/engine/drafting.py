"""Speculative drafts: guesses of the tokens that follow a request's last one, verified in its next decode.

A decode with k drafts computes its last token plus the k drafts in one chunk, and the step draws a token after
each of the k + 1 positions exactly as k + 1 plain decodes would (the kernels are batch- and chunk-invariant, the
draw is a pure function of (seed, position, token id), and each row sees the penalties, bans and grammar of
the output as it would stand there). The output stage keeps the draws up to the first that differs from its
draft, so a draft costs compute but never changes a bit of the output.

Two sources, both free to propose:
- n-gram (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last n
  tokens, n from prompt_lookup_max down to prompt_lookup_min (where those run into the end, the run since the
  occurrence, repeated). Copy-heavy work (edits of a given file, answers quoting their sources) repeats long
  runs of its prompt.
- grammar fast-forward: where the request's grammar allows one continuation only (a JSON key, a tool call's
  fixed fields), those tokens.

Drafts cost where they are rejected, so each request adapts. It keeps a running estimate a of how often a draft
is kept where the ones before it were (decayed hits over hits plus misses: each verify adds the drafts it kept
and, if it stopped early, one miss); the k-th draft of a run is kept with probability about a^k, and pays where
that beats what one more row costs the step (ROW_COST, measured: ~15% of a one-row step here) times the tokens the
step makes anyway, its decodes. So a lone stream drafts while a >= ~0.15 per position, four streams only while
drafts are kept more often than not, and eight or more almost never. A verify that kept nothing, or an estimate
that allows no draft at all, makes the request wait 1, 2, 4 ... steps before it drafts again, at least one
(the wait resets with the next acceptance). The step's decodes plus drafts also stay within
SpeculativeConfig.max_step_rows; the requests most likely to be right draft first. Grammar-forced tokens are
always kept, and cost their rows only.
"""

import math
from collections import Counter
from dataclasses import dataclass, field

from server.engine.config import SpeculativeConfig
from server.engine.request import FinishReason
from server.engine.request_state import Request
from server.engine.scheduler import ScheduledChunk

MAX_BACKOFF = 64  # steps a request may wait before drafting again
# A draft row's cost, as a share of a one-row decode step (the 135M default on Zen 4, 2026-11-27: 5.8 ms for one
# token, +0.3 to +1.3 ms for each draft up to 8): a draft pays where a^k > ROW_COST * the step's decodes
ROW_COST = 0.15
DECAY = 0.8  # the weight of a request's older verifies in its acceptance estimate, per verify


@dataclass(slots=True)
class _Drafts:
    """One request's n-gram index and its adaptive draft length."""

    # an n-gram -> the position right after its latest occurrence that has a token after it
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # n-grams ending before this position are in the index
    # decayed drafts kept, and verifies that stopped before their last draft; the prior, a = 0.8, lets a new
    # request draft in full alone and two drafts beside three others
    hits: float = 2.0
    misses: float = 0.5
    wait: int = 0  # steps to skip before drafting again
    backoff: int = 1  # the next wait
    trial: bool = False  # after the wait, one draft to test the estimate

    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)


PRIOR_ACCEPTANCE = _Drafts().acceptance()  # a request's estimate before its first verify


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
        bar = ROW_COST * len(decoding)  # what the k-th draft's chance a^k must beat
        room = self.config.max_step_rows - len(decoding)
        # sorted is stable: ties keep their running order
        for request in sorted(decoding, key=self._acceptance, reverse=True):
            if room <= 0:
                break
            request.draft_token_ids = self._propose(request, room, self._worth(request, bar))
            room -= len(request.draft_token_ids)

    def _acceptance(self, request: Request) -> float:
        state = self._states.get(request.request_id)
        return state.acceptance() if state is not None else PRIOR_ACCEPTANCE

    def _worth(self, request: Request, bar: float) -> int:
        """How many drafts pay for their rows: the largest k with a^k > bar (a < 1: misses never decay to 0)."""
        a = self._acceptance(request)
        if bar >= 1.0 or a <= bar:
            return 0
        return min(self.config.num_speculative_tokens, int(math.log(bar) / math.log(a)))

    def _record(self, request: Request, drafts: list[int], kept: list[int]) -> None:
        num_accepted = accepted_drafts(drafts, kept)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        state = self._states.get(request.request_id)
        if state is None:
            return
        state.hits = DECAY * state.hits + num_accepted
        state.misses = DECAY * state.misses + (num_accepted < len(drafts))
        if num_accepted == 0:
            self._back_off(state)
        else:
            state.backoff = 1

    @staticmethod
    def _back_off(state: _Drafts) -> None:
        state.wait, state.backoff, state.trial = state.backoff, min(2 * state.backoff, MAX_BACKOFF), True

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose(self, request: Request, room: int, worth: int) -> list[int]:
        """A decode's drafts, at most `room`: the tokens its grammar forces (always kept), else up to `worth`
        n-gram drafts; none while it waits, and at least one, to try, once a wait is over."""
        if not request.params.speculative:
            return []
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _Drafts()
        # the output may not outgrow max_tokens: a draft past it could never be kept
        room = min(
            room,
            self.config.num_speculative_tokens,
            request.params.max_tokens - len(request.output_token_ids) - 1,
        )
        if room <= 0:
            return []
        if request.grammar is not None:
            forced = request.grammar.forced_tokens()[:room]
            if forced:
                return forced
        if state.wait > 0:
            state.wait -= 1
            return []
        if state.trial:
            state.trial, worth = False, max(worth, 1)
        elif worth == 0:  # no draft pays now: wait, then try one
            self._back_off(state)
            return []
        drafts = self._lookup(request, state, min(worth, room))
        if drafts and request.grammar is not None:  # the grammar must allow them: a mask needs a valid past
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def _lookup(self, request: Request, state: _Drafts, k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix (of the allowed lengths)
        that occurred before, the run up to the end repeated where they reach it."""
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
                run = request.token_slice(after, min(after + k, length))
                # A match that reaches the end overlaps the suffix: the sequence repeats with period
                # length - after (a loop, a rule of dashes, a column of zeros), so its drafts repeat the run
                return [run[i % len(run)] for i in range(k)]
        return []
