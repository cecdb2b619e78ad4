"""Running requests through a synchronous Engine to completion, and what must hold once they are done."""

import random

from server.engine.engine import Engine
from server.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams | dict = GREEDY, aborts=()):
    """Run requests to completion; returns {id: (token ids, text, finish reason)}."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid] if isinstance(params, dict) else params)
    for rid in aborts:
        engine.abort(rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    texts = {rid: "" for rid in prompts}
    reasons = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], texts[rid], reasons.get(rid)) for rid in prompts}


def served_bits(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams):
    """Serve the prompts together (params asking for logprobs): each one's tokens, logprobs (the bits) and cached
    prompt tokens, checking the block manager's invariants after every step; and the most blocks held at once."""
    results = {rid: {"ids": [], "logprobs": [], "cached": None} for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    bm, most = engine.scheduler.block_manager, 0
    while engine.has_work():
        for out in engine.step():
            r = results[out.request_id]
            r["ids"] += out.new_token_ids
            r["logprobs"] += [(lp.logprob, lp.top) for lp in out.logprobs or []]
            if r["cached"] is None:
                r["cached"] = out.num_cached_tokens
        most = max(most, sum(ref > 0 for ref in bm.ref_counts))
        bm.check_invariants()
    return results, most


def alone(engine: Engine, prompts: dict[str, list[int]], params=GREEDY):
    results = {}
    for rid, ids in prompts.items():
        results.update(run(engine, {rid: ids}, params[rid] if isinstance(params, dict) else params))
    return results


def assert_all_blocks_free(engine: Engine):
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == engine.runner.num_blocks
    assert engine.stats().kv_cache_usage == 0.0
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def random_prompts(n, vocab, seed=0, low=4, high=60, prefix="r"):
    rng = random.Random(seed)
    return {
        f"{prefix}{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for i in range(n)
    }
