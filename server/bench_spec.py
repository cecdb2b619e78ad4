"""kvserve bench-spec: speculative decoding on against off, on workloads that copy a lot and ones that copy nothing.

Each workload runs with drafts and without, alternated `rounds` times (the host's drift hits both alike), at each
concurrency; medians. The outputs are the same either way (drafts change no bit), so both runs generate the same
tokens and tokens/s compare directly.
"""

import dataclasses
import json
import statistics
import time

from server.engine.config import SpeculativeConfig
from server.engine.engine import Engine
from server.engine.request import GrammarSpec, SamplingParams

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


def workloads(engine: Engine, max_tokens: int) -> dict[str, list[tuple[list[int], SamplingParams]]]:
    """name -> its requests (prompt ids, params): edit (return a file with one change), quote (answer by quoting
    a passage), chat (open questions: nothing to copy), json (records under a JSON schema)."""
    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], True, None))

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    person = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    return {
        "edit": [
            (
                chat(
                    f"Return this file with `{old}` renamed to `{new}`, and nothing else changed:\n\n{SOURCE}"
                ),
                greedy,
            )
            for old, new in [("total_cents", "amount_cents"), ("load_orders", "read_orders")]
        ],
        "quote": [
            (chat(f"{PASSAGE}\n\nQuoting the text above, {question}"), greedy)
            for question in ["when was the lighthouse automated and who left?", "what did the lamp burn?"]
        ],
        "chat": [(chat(text), greedy) for text in CHAT],
        "json": [
            (
                chat(f"Make up a person who lives in {city}, as JSON."),
                dataclasses.replace(greedy, grammar=person),
            )
            for city in ["Lisbon", "Osaka"]
        ],
    }


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], tag: str) -> tuple[int, float]:
    """All requests at once to their ends: (output tokens, seconds)."""
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", prompt, params)
    num_tokens = 0
    while engine.has_work():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    return num_tokens, time.perf_counter() - start


def at_concurrency(requests: list[tuple[list[int], SamplingParams]], concurrency: int):
    """`concurrency` requests cycling through the workload's; past one, each samples (temperature 0.7, its own
    seed) so that they do not all write the same tokens."""
    if concurrency == 1:
        return [[r] for r in requests]  # one at a time
    batch = []
    for i in range(concurrency):
        prompt, params = requests[i % len(requests)]
        batch.append((prompt, dataclasses.replace(params, temperature=0.7, seed=i)))
    return [batch]


def bench_spec(
    engine: Engine, spec: SpeculativeConfig, concurrency: list[int], rounds: int, max_tokens: int
) -> dict:
    results = []
    for name, requests in workloads(engine, max_tokens).items():
        for c in concurrency:
            groups = at_concurrency(requests, c)
            tokens_per_s = {"off": [], "on": []}
            drafted = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
            for r in range(rounds + 1):  # the first round warms up and is not counted
                for mode, config in (("off", None), ("on", spec)):
                    engine.reset(speculative=config)
                    tokens, seconds = 0, 0.0
                    for g, group in enumerate(groups):
                        n, s = run(engine, group, f"{name}-{c}-{mode}-{r}-{g}")
                        tokens, seconds = tokens + n, seconds + s
                    if r == 0:
                        continue
                    tokens_per_s[mode].append(tokens / seconds)
                    if mode == "on":
                        stats = engine.stats()
                        drafted["drafts"] += stats.num_drafts
                        drafted["draft_tokens"] += stats.num_draft_tokens
                        drafted["accepted"] += stats.num_accepted_tokens
            off, on = statistics.median(tokens_per_s["off"]), statistics.median(tokens_per_s["on"])
            results.append(
                {
                    "workload": name,
                    "concurrency": c,
                    "output_tokens": tokens,
                    "off_tokens_per_s": round(off, 1),
                    "on_tokens_per_s": round(on, 1),
                    "speedup": round(on / off, 2),
                    "acceptance_rate": round(drafted["accepted"] / max(drafted["draft_tokens"], 1), 3),
                    # tokens a verified decode yields: its draw plus the drafts it kept (vLLM's mean length)
                    "mean_accepted_length": round(1 + drafted["accepted"] / max(drafted["drafts"], 1), 2),
                }
            )
    engine.reset(speculative=None)
    return {
        "speculative": dataclasses.asdict(spec),
        "rounds": rounds,
        "max_tokens": max_tokens,
        "results": results,
    }
