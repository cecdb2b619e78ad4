"""A reply as a row of blocks, each text or one tool call, for the APIs that stream it so (Responses' output
items, Messages' content blocks): the tool-call parser's content and call pieces become the opening, growth and
closing of blocks, one block open at a time."""

from dataclasses import dataclass, field

from server.api.tools import CallDelta, ToolCallParser


@dataclass(slots=True)
class Block:
    index: int  # in the reply
    call: CallDelta | None  # a call's first piece (its id and name); None for text
    text: str = ""  # the text, or the call's arguments, so far


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
    parser: ToolCallParser | None = None  # None: no tools offered, the reply is text
    blocks: list[Block] = field(default_factory=list)
    open: Block | None = None

    @property
    def num_calls(self) -> int:
        return sum(b.call is not None for b in self.blocks)

    def feed(self, text: str, final: bool) -> list[Step]:
        """What one text delta of the reply does to its blocks; at the end (final) the open block closes."""
        calls: list[CallDelta] = []
        if self.parser is not None:
            text, calls = self.parser.feed(text, final)
        # The parser gives content and calls apart. Within one delta, the pieces that go on with the open call
        # come first, then the content (it can only follow a call's end), then new calls.
        n = 0
        while n < len(calls) and calls[n].id is None:
            n += 1
        steps: list[Step] = []
        for call in calls[:n]:
            steps += self._add(call, call.arguments)
        if text:
            steps += self._add(None, text)
        for call in calls[n:]:
            steps += self._add(call, call.arguments)
        if final and self.open is not None:
            steps.append(Closed(self.open))
            self.open = None
        return steps

    def _add(self, call: CallDelta | None, piece: str) -> list[Step]:
        steps: list[Step] = []
        # text goes on with open text; a call's first piece (it has the id) always opens a block
        goes_on = self.open is not None and (self.open.call is None if call is None else call.id is None)
        if not goes_on:
            if self.open is not None:
                steps.append(Closed(self.open))
            self.open = Block(len(self.blocks), call)
            self.blocks.append(self.open)
            steps.append(Opened(self.open))
        if piece:
            self.open.text += piece
            steps.append(Grew(self.open, piece))
        return steps
