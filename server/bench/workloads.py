"""The prompts of kvserve's benchmark workloads, as user messages: shared by `kvserve bench` (over HTTP, against
any server) and `kvserve bench-spec` (in process), so both measure the same work.

- edit: return a given file with one change (copies almost all of its prompt);
- quote: answer a question by quoting a given passage (copies parts of its prompt);
- chat: open questions (nothing to copy);
- json: records under a JSON schema (PERSON).
"""

# A passage a question is answered from, by quoting it.
PASSAGE = (
    "The lighthouse at Cape Morrow was built in 1871 from granite quarried two miles inland. Its lamp burned "
    "whale oil until 1889, then kerosene until 1923, when the keepers' cottage was wired for electricity. The "
    "last keeper, Edith Lund, left in 1961, after the light was automated; she had kept it for twenty-two years "
    "and logged every ship that passed in a ledger now held by the county museum. In 1994 the tower was listed "
    "as a historic site, and since 2003 it has been open to visitors on summer weekends."
)
# A file to return with one change: fixed here, so that the workload does not drift with kvserve's own sources.
SOURCE = """import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Order:
    order_id: str
    customer: str
    items: list[str]
    total_cents: int


def load_orders(path: Path) -> list[Order]:
    orders = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        orders.append(Order(record["id"], record["customer"], record["items"], record["total"]))
    return orders


def total_by_customer(orders: list[Order]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for order in orders:
        totals[order.customer] = totals.get(order.customer, 0) + order.total_cents
    return totals


def largest_order(orders: list[Order]) -> Order | None:
    return max(orders, key=lambda order: order.total_cents, default=None)
"""
CHAT = [
    "Write a short poem about the sea.",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Why is the sky blue? Answer in a paragraph.",
    "Describe your ideal weekend.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}

EDITS = [("total_cents", "amount_cents"), ("load_orders", "read_orders")]
QUESTIONS = ["when was the lighthouse automated and who left?", "what did the lamp burn?"]
CITIES = ["Lisbon", "Osaka"]


def user_messages(workload: str) -> list[str]:
    """The user messages of a workload (edit, quote, chat or json), in order."""
    if workload == "edit":
        return [
            f"Return this file with `{old}` renamed to `{new}`, and nothing else changed:\n\n{SOURCE}"
            for old, new in EDITS
        ]
    if workload == "quote":
        return [f"{PASSAGE}\n\nQuoting the text above, {question}" for question in QUESTIONS]
    if workload == "chat":
        return list(CHAT)
    if workload == "json":
        return [f"Make up a person who lives in {city}, as JSON." for city in CITIES]
    raise ValueError(f"unknown workload {workload!r}")
