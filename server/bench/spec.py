"""kvserve bench-spec: speculative decoding on against off, on workloads that copy a lot and ones that copy nothing.

Each workload runs with drafts and without, alternated `rounds` times (the host's drift hits both alike; which
runs first alternates too), at each concurrency; medians. The outputs are the same either way (drafts change no
bit), so both runs generate the same tokens and tokens/s compare directly.
"""

import dataclasses
import json
import statistics
import time

from server.bench.workloads import PERSON, user_messages
from server.engine.config import SpeculativeConfig
from server.engine.engine import Engine
from server.engine.request import GrammarSpec, SamplingParams


def workloads(engine: Engine, max_tokens: int) -> dict[str, list[tuple[list[int], SamplingParams]]]:
    """name -> its requests (prompt ids, params): workloads.py's edit, quote, chat and json (the last
    under its JSON schema), greedy; and chat-sampled, the chat prompts drawn at temperature 1, each with its own
    seed (what drafts cost where they are mostly wrong)."""
    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], True, None))

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    person = engine.grammars.compile(GrammarSpec("json_schema", json.dumps(PERSON)))
    requests = {
        name: [(chat(text), params) for text in user_messages(name)]
        for name, params in (
            ("edit", greedy),
            ("quote", greedy),
            ("chat", greedy),
            ("json", dataclasses.replace(greedy, grammar=person)),
        )
    }
    requests["chat-sampled"] = [
        (prompt, dataclasses.replace(greedy, temperature=1.0, seed=i))
        for i, (prompt, _) in enumerate(requests["chat"])
    ]
    return requests


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
    """`concurrency` requests cycling through the workload's; past one, each samples (at temperature 0.7 where
    the workload is greedy) with its own seed, so that they do not all write the same tokens."""
    if concurrency == 1:
        return [[r] for r in requests]  # one at a time
    batch = []
    for i in range(concurrency):
        prompt, params = requests[i % len(requests)]
        batch.append((prompt, dataclasses.replace(params, temperature=params.temperature or 0.7, seed=i)))
    return [batch]


def bench_spec(
    engine: Engine,
    spec: SpeculativeConfig,
    names: list[str],
    concurrency: list[int],
    rounds: int,
    max_tokens: int,
) -> dict:
    results = []
    requests_of = workloads(engine, max_tokens)
    for name in names:
        requests = requests_of[name]
        for c in concurrency:
            groups = at_concurrency(requests, c)
            tokens_per_s = {"off": [], "on": []}
            drafted = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
            for r in range(rounds + 1):  # the first round warms up and is not counted
                # off first in even rounds, on first in odd ones: whatever a run leaves behind (garbage to
                # collect, a warmer cache) falls on each mode alike
                modes = (("off", None), ("on", spec))
                for mode, config in modes if r % 2 == 0 else modes[::-1]:
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
