"""A request's place against its reasoning (SamplingParams.reasoning): a thinking model writes it before its
answer, and what the request asks of the output is asked of the answer alone.

Three phases. OPENING: the template left it to the model whether to think, so its first token decides (the
reasoning's opening token, or the answer's first). THINKING: free text until the end tokens come in a row, the
grammar held back meanwhile; once the budget is spent, FORCING: the close tokens are drawn one by one. When the
reasoning ends the request's grammar takes over (Request.grammar), from the next token on (or from the answer's
first token, when OPENING decided there is no reasoning).

While a phase masks the draw (OPENING under a grammar: the grammar's first tokens or the opening; FORCING: the
next close token), the request gets no drafts: the draft rows' masks would need the phase after each draft. A
phase that changes in the middle of a verified run ends the run there (OutputProcessor._keep): the draws after
it were made under the previous phase's masks.
"""

import enum

import torch

from server.engine.grammar import GrammarState
from server.engine.request import ReasoningSpec


class Phase(enum.Enum):
    OPENING = "opening"
    THINKING = "thinking"
    FORCING = "forcing"


class ReasoningState:
    def __init__(self, spec: ReasoningSpec, grammar: GrammarState | None):
        self.spec = spec
        self.grammar = grammar  # the request's, waiting for the answer
        self.phase = Phase.OPENING if spec.opens_with is not None else Phase.THINKING
        self.num_tokens = 0  # of reasoning so far (the opening and closing tokens included)
        self.num_forced = 0  # of spec.close, once the budget ran out
        self._tail: list[int] = []  # the latest len(spec.end) tokens

    @property
    def masks(self) -> bool:
        """Whether this phase decides the next draw's mask."""
        return self.phase is Phase.FORCING or (self.phase is Phase.OPENING and self.grammar is not None)

    @property
    def steers_draws(self) -> bool:
        """Whether a token drawn now may change how the next draw is masked: this phase masks, a grammar waits for
        the answer, or a budget may run out and force the close."""
        return self.masks or self.grammar is not None or self.spec.budget is not None

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """The allowed next tokens into `row` ([ceil(V / 32)] int32), as GrammarState.fill_bitmask."""
        if self.phase is Phase.FORCING:
            row.zero_()
            _allow(row, self.spec.close[self.num_forced])
        else:  # OPENING under a grammar: the answer as the grammar starts it, or the reasoning
            self.grammar.fill_bitmask(row)
            _allow(row, self.spec.opens_with)

    def masks_along(self, token_ids: list[int], rows: torch.Tensor) -> None:
        # a masking phase has no drafts (drafting.py): one row
        self.fill_bitmask(rows[0])

    def advance(self, token_id: int) -> tuple[bool, bool]:
        """Take the token drawn next: (the reasoning is over, the token is the answer's first). The second holds
        only where OPENING met a token other than the opening: there was no reasoning."""
        if self.phase is Phase.OPENING:
            if token_id != self.spec.opens_with:
                return True, True
            self.phase = Phase.THINKING
            self.num_tokens = 1
            return False, False
        self.num_tokens += 1
        if self.phase is Phase.FORCING:
            self.num_forced += 1
        self._tail = (self._tail + [token_id])[-len(self.spec.end) :]
        if tuple(self._tail) == self.spec.end:
            return True, False
        budget = self.spec.budget
        if self.phase is Phase.THINKING and budget is not None and self.num_tokens >= budget:
            self.phase = Phase.FORCING
            self.num_forced = _overlap(self._tail, self.spec.close)
        return False, False


def _allow(row: torch.Tensor, token_id: int) -> None:
    word, bit = divmod(token_id, 32)
    # int32 words: bit 31 is the sign bit
    row[word] = int(row[word]) | (1 << bit) if bit < 31 else int(row[word]) | -(1 << 31)


def _overlap(tail: list[int], close: tuple[int, ...]) -> int:
    """How many of close's first tokens the output already ends with (a budget that ran out just after the model
    began closing by itself continues that close rather than starting it again)."""
    for n in range(min(len(tail), len(close) - 1), 0, -1):
        if tuple(tail[-n:]) == close[:n]:
            return n
    return 0
