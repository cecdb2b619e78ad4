"""The Responses API's store (server/api/openai/response_store.py): bounded by bytes, least recently used out
first, conversations as chains of responses."""

import pytest

from server.api.openai import responses_protocol as rp
from server.api.openai.response_store import ResponseStore

REQUEST = rp.ResponsesRequest.model_validate({"input": "hi"})


def answered(response_id: str, text: str, previous: str | None = None) -> rp.ResponseObject:
    message = rp.OutputMessage(
        id=f"msg_{response_id}", status="completed", content=[rp.OutputText(text=text)]
    )
    return rp.ResponseObject(
        id=response_id,
        created_at=0,
        status="completed",
        model="m",
        output=[message],
        parallel_tool_calls=True,
        temperature=1.0,
        top_p=1.0,
        tool_choice="auto",
        tools=[],
        text=REQUEST.text,
        previous_response_id=previous,
    )


def said(text: str) -> list:
    return rp.ResponsesRequest.model_validate({"input": text}).input


def test_a_conversation_is_its_chain_of_inputs_and_outputs_oldest_first():
    store = ResponseStore(1 << 20)
    store.put(answered("r1", "Hello Ada."), said("I am Ada."))
    store.put(answered("r2", "Ada.", previous="r1"), said("Who am I?"))
    turns = [(item.role, item.content[0].text) for item in store.conversation("r2")]
    assert turns == [
        ("user", "I am Ada."),
        ("assistant", "Hello Ada."),
        ("user", "Who am I?"),
        ("assistant", "Ada."),
    ]
    assert store.delete("r1") and not store.delete("r1")
    with pytest.raises(KeyError) as e:  # names the turn that is gone
        store.conversation("r2")
    assert e.value.args[0] == "r1"


def test_the_store_holds_its_bytes_dropping_the_least_recently_used():
    size = ResponseStore(1 << 20)
    assert size.put(answered("r0", "x" * 1000), said("y" * 1000))
    one = size.bytes
    assert 2000 < one < 3000  # about its JSON's bytes
    store = ResponseStore(3 * one + one // 2)  # room for three
    for i in range(3):
        store.put(answered(f"r{i}", "x" * 1000), said("y" * 1000))
    assert store.get("r0") is not None  # used: now the most recent
    store.put(answered("r3", "x" * 1000), said("y" * 1000))
    assert store.get("r1") is None and all(store.get(f"r{i}") for i in (0, 2, 3))
    assert len(store) == 3 and store.bytes == 3 * one <= store.max_bytes
    # one larger than the whole store is not kept, and nothing is dropped for it
    assert not store.put(answered("big", "x" * 10 * one), said("y"))
    assert store.get("big") is None and len(store) == 3
    # kept again under the same id: counted once
    store.put(answered("r3", "x" * 1000), said("y" * 1000))
    assert len(store) == 3 and store.bytes == 3 * one
