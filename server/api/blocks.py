"""A reply as a row of blocks, each reasoning, text or one tool call, for the APIs that stream it so (Responses'
output items, Messages' content blocks): the reply parser's pieces (reasoning, content, call pieces) become the
opening, growth and closing of blocks, one block open at a time."""

from dataclasses import dataclass, field

from server.api.reasoning import ReplyParser
from server.api.tools import CallDelta
from server.engine.request import RequestOutput


@dataclass(slots=True)
class Block:
    index: int  # in the reply
    call: CallDelta | None  # a call's first piece (its id and name); None for text and reasoning
    text: str = ""  # the text, or the call's arguments, so far
    reasoning: bool = False  # the model's reasoning, not its answer


@dataclass(slots=True)
class Opened:
    block: Block


@dataclass(slots=True)
class Grew:
    block: Block
    piece: str


@dataclass(slots=True)
class Closed:
    block: Block


Step = Opened | Grew | Closed


@dataclass
class ReplyBlocks:
    parser: ReplyParser
    blocks: list[Block] = field(default_factory=list)
    open: Block | None = None

    @property
    def num_calls(self) -> int:
        return sum(b.call is not None for b in self.blocks)

    @property
    def num_reasoning_tokens(self) -> int:
        return self.parser.num_reasoning_tokens

    def feed(self, out: RequestOutput) -> list[Step]:
        """What one engine output of the reply does to its blocks; at the end (finished) the open block closes."""
        steps: list[Step] = []
        for piece in self.parser.feed(out):
            if piece.kind == "call":
                steps += self._add(piece.call, piece.call.arguments, False)
            else:
                steps += self._add(None, piece.text, piece.kind == "reasoning")
        if out.finished and self.open is not None:
            steps.append(Closed(self.open))
            self.open = None
        return steps

    def _add(self, call: CallDelta | None, piece: str, reasoning: bool) -> list[Step]:
        steps: list[Step] = []
        # text goes on with open text, reasoning with open reasoning; a call's first piece (it has the id) always
        # opens a block
        open = self.open
        if call is None:
            goes_on = open is not None and open.call is None and open.reasoning == reasoning
        else:
            goes_on = open is not None and open.call is not None and call.id is None
        if not goes_on:
            if open is not None:
                steps.append(Closed(open))
            self.open = Block(len(self.blocks), call, reasoning=reasoning)
            self.blocks.append(self.open)
            steps.append(Opened(self.open))
        if piece:
            self.open.text += piece
            steps.append(Grew(self.open, piece))
        return steps
