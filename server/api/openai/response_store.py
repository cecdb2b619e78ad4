"""The responses kvserve keeps, for `previous_response_id` and GET and DELETE /v1/responses/{id}: in this
process's memory, as their JSON, within --responses-store-memory; past that the least recently used go first. A
response refers to the one it continued by id, so a conversation of N turns is kept once, not N times over; one
whose chain lost a response to eviction can no longer be continued (a 404 says which). Nothing outlives the
process, and replicas do not share what they keep."""

import json
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import TypeAdapter

from server.api.openai import responses_protocol as rp

INPUT_ITEMS = TypeAdapter(list[rp.InputItem])


@dataclass(frozen=True, slots=True)
class StoredResponse:
    # As JSON, not as Pydantic objects: a budget of bytes then holds about what it says (an object of small
    # fields takes several times its JSON's bytes), and a kept response is read only when asked for.
    response: bytes  # the ResponseObject, as it was answered
    input: bytes  # its own input items, not those of the responses it continued
    previous_id: str | None

    @property
    def size(self) -> int:
        return len(self.response) + len(self.input)


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: rp.ResponseObject, input_items: list[rp.InputItem]) -> bool:
        """Keep a finished response; False when it alone is larger than the whole store."""
        stored = StoredResponse(
            response.model_dump_json().encode(),
            INPUT_ITEMS.dump_json(input_items),
            response.previous_response_id,
        )
        if stored.size > self.max_bytes:
            return False
        self.delete(response.id)
        while self.bytes + stored.size > self.max_bytes:
            _, evicted = self._kept.popitem(last=False)
            self.bytes -= evicted.size
        self._kept[response.id] = stored
        self.bytes += stored.size
        return True

    def get(self, response_id: str) -> rp.ResponseObject | None:
        stored = self._touch(response_id)
        return None if stored is None else rp.ResponseObject.model_validate_json(stored.response)

    def input_items(self, response_id: str) -> list[rp.InputItem] | None:
        """The input items the response was asked with (not those of the responses it continued)."""
        stored = self._touch(response_id)
        return None if stored is None else INPUT_ITEMS.validate_json(stored.input)

    def delete(self, response_id: str) -> bool:
        stored = self._kept.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None

    def conversation(self, response_id: str) -> list[rp.InputItem]:
        """The input items that continue the response: every input and output of its chain, oldest first.
        KeyError naming the first response of the chain no longer kept."""
        turns: list[list[rp.InputItem]] = []
        while response_id is not None:
            stored = self._touch(response_id)
            if stored is None:
                raise KeyError(response_id)
            # each output item read back, from the response's JSON, as the input item it becomes
            answer = INPUT_ITEMS.validate_python(json.loads(stored.response)["output"])
            turns.append(INPUT_ITEMS.validate_json(stored.input) + answer)
            response_id = stored.previous_id
        return [item for turn in reversed(turns) for item in turn]

    def _touch(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored
