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
and, if it stopped early, one miss); the k-th draft of a run is kept with probability about a^k. What a row
costs depends on the host: a draft row adds ~15% to a one-row step where the CPU multiplies bfloat16 (Zen 4),
~40% where the int16 products of an AVX2 core are the limit (Zen 3), and more once a step's rows leave the
GEMMs' few-row path. So the drafter times the steps it sees: StepCosts keeps the recent seconds of decode-only
steps by their decodes and drafts, and each step verifies the number of drafts, most likely first, that makes
the most tokens a second by those costs (the step's decodes plus the drafts' chances, over the seconds of such a
step). Steps not timed yet cost ROW_COST a row, an optimistic guess that gets them tried and timed.
A request whose drafts were all left out, or whose verify kept nothing, waits 1, 2, 4 ... steps before it
drafts again (a verify that keeps any halves the next wait); after a wait its first draft counts as sure, so that it
is tried wherever a kept draft would pay, and its verify updates the estimate. Grammar-forced tokens are sure
drafts, verified wherever a sure token pays for its row. The step's decodes plus drafts stay within
SpeculativeConfig.max_step_rows.
"""

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from server.engine.config import SpeculativeConfig
from server.engine.request import FinishReason
from server.engine.request_state import Request
from server.engine.scheduler import ScheduledChunk

MAX_BACKOFF = 64  # steps a request may wait before drafting again
# A draft row's cost, as a share of a one-row decode step, for step sizes not yet timed (the 135M default on Zen 4,
# 2026-11-27: 5.8 ms for one token, +0.3 to +1.3 ms for each draft up to 8): low, so that they get tried
ROW_COST = 0.15
DECAY = 0.8  # the weight of a request's older verifies in its acceptance estimate, per verify
TIMED_STEPS = 15  # a step's cost: the median of the latest this many decode-only steps of its shape
MIN_TIMED = 3  # ... once it has this many (one slow step, a collection or the host's noise, cannot decide)


class StepCosts:
    """Seconds of the latest decode-only steps, by their decodes and drafts. A draft row costs a little more
    than a decode's (its sequence's attention has one more query: units of work split less evenly), so the two
    are kept apart (Zen 3, four sampled streams: 3 decodes + 1 draft 9.7 ms, 4 decodes 9.0 ms)."""

    def __init__(self):
        self._seconds: dict[tuple[int, int], deque[float]] = {}

    def record(self, decodes: int, drafts: int, seconds: float) -> None:
        self._seconds.setdefault((decodes, drafts), deque(maxlen=TIMED_STEPS)).append(seconds)

    def timed(self, decodes: int, drafts: int) -> float | None:
        """The median seconds of such a step, once MIN_TIMED of them were seen."""
        times = self._seconds.get((decodes, drafts))
        return statistics.median(times) if times is not None and len(times) >= MIN_TIMED else None

    def seconds(self, decodes: int, most: int) -> list[float]:
        """What a step of `decodes` decodes costs with 0 .. `most` drafts: each one's timed seconds; else those of
        the nearest timed one (the fewer drafts first) grown or shrunk by ROW_COST of a one-row step a row; in
        units of a one-row step where none is. So every shape one decision compares is on one scale."""
        timed = [self.timed(decodes, k) for k in range(most + 1)]
        guess = [1 + ROW_COST * (decodes + k - 1) for k in range(most + 1)]
        known = [k for k, t in enumerate(timed) if t is not None]
        if not known:
            return guess
        costs = []
        for k, t in enumerate(timed):
            if t is None:
                j = min(known, key=lambda j: (abs(j - k), j))
                t = timed[j] * guess[k] / guess[j]
            costs.append(t)
        return costs


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


@dataclass(slots=True)
class _Proposal:
    """A decode's candidate drafts for the next step, with each one's chance of being kept."""

    request: Request
    drafts: list[int]
    chances: list[float]  # a^k for the k-th; 1 for a grammar's forced tokens and a trial's first
    forced: bool  # the grammar's forced tokens: no wait or trial to keep track of


class Drafter:
    def __init__(self, config: SpeculativeConfig, costs: StepCosts | None = None):
        self.config = config
        self.costs = costs if costs is not None else StepCosts()  # the engine's, which outlives a drafter
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
        seconds: float | None = None,
    ) -> None:
        """Learn what the step's verifies kept and, for a step of decodes only, what a step of its shape costs
        (its `seconds`); then draft for the next step."""
        for c in chunks:
            if c.drafts:
                self._record(c.request, c.drafts, kept.get(c.request.request_id, []))
        if seconds is not None and chunks and all(c.num_tokens == 1 + len(c.drafts) for c in chunks):
            self.costs.record(len(chunks), sum(len(c.drafts) for c in chunks), seconds)
        for request_id in finished:
            self.forget(request_id)
        for request in running:
            request.draft_token_ids = []
        # a prefill-only request one token short of its end is no decode: it never draws
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1 and r.pooling is None]
        room = self.config.max_step_rows - len(decoding)
        if room <= 0:
            return
        # sorted is stable: ties keep their running order
        proposals = [self._propose(r, room) for r in sorted(decoding, key=self._acceptance, reverse=True)]
        # every candidate, most likely first (a request's in its own order: its chances fall), as many as pay
        candidates = sorted(
            ((chance, i) for i, p in enumerate(proposals) for chance in p.chances), key=lambda c: -c[0]
        )[:room]
        if not candidates:
            return
        counts = [0] * len(proposals)
        for _, i in candidates[: self._most_tokens_a_second(len(decoding), [c for c, _ in candidates])]:
            counts[i] += 1
        for p, n in zip(proposals, counts, strict=True):
            p.request.draft_token_ids = p.drafts[:n]
            if p.forced or not p.drafts:
                continue
            state = self._states[p.request.request_id]
            if n == 0:  # none paid: wait, then try one
                self._back_off(state)
            else:
                state.trial = False

    def _most_tokens_a_second(self, decodes: int, chances: list[float]) -> int:
        """How many of the drafts (their chances, highest first) a step of `decodes` decodes should verify: the
        number that makes the most tokens a second, by StepCosts."""
        seconds = self.costs.seconds(decodes, self.config.max_step_rows - decodes)
        tokens = float(decodes)
        best, best_rate = 0, tokens / seconds[0]
        for n, chance in enumerate(chances, 1):
            tokens += chance
            if tokens / seconds[n] > best_rate:
                best, best_rate = n, tokens / seconds[n]
        return best

    def _acceptance(self, request: Request) -> float:
        state = self._states.get(request.request_id)
        return state.acceptance() if state is not None else PRIOR_ACCEPTANCE

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
        else:  # halved, not reset: where half the verifies keep nothing, the waits grow
            state.backoff = max(state.backoff // 2, 1)

    @staticmethod
    def _back_off(state: _Drafts) -> None:
        state.wait, state.backoff, state.trial = state.backoff, min(2 * state.backoff, MAX_BACKOFF), True

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _propose(self, request: Request, room: int) -> _Proposal:
        """A decode's candidate drafts, at most `room`: the tokens its grammar forces (sure to be kept), else its
        n-gram drafts; none while it waits. Once a wait is over, the first draft counts as sure, so that it is
        tried wherever a kept draft would pay (its verify then updates the estimate)."""
        none = _Proposal(request, [], [], False)
        if not request.params.speculative or (request.grammar is None and request.constraint is not None):
            return none  # its reasoning's phase masks the next draw (reasoning.py): no drafts meanwhile
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
            return none
        if request.grammar is not None:
            forced = request.grammar.forced_tokens()[:room]
            if forced:
                return _Proposal(request, forced, [1.0] * len(forced), True)
        if state.wait > 0:
            state.wait -= 1
            return none
        drafts = self._lookup(request, state, room)
        if drafts and request.grammar is not None:  # the grammar must allow them: a mask needs a valid past
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        a = state.acceptance()
        chances = [a ** (k + 1) for k in range(len(drafts))]
        if state.trial and chances:
            chances[0] = 1.0
        return _Proposal(request, drafts, chances, False)

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
