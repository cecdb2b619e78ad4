"""Async scheduling (server/engine/engine.py): each step scheduled and launched before the one before it is read
back, its decodes fed the tokens that step drew where they are. What a client gets is what it gets from steps run
one after the other, request by request, whatever ends a request, under preemption, prefix hits, aborts, and with
requests whose draws read their own output (penalties) mixed in. On a CPU the steps run in turn, so these tests
check the bookkeeping; tests/engine/test_backend.py checks on a GPU that a launch never waits for the device."""

import pytest

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from tests.helpers.engine_runs import assert_all_blocks_free, random_prompts, run
from tests.helpers.tiny_models import tiny_family


def make_engine(path, async_scheduling: bool, **changes) -> Engine:
    config = dict(kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                  dtype="float32", batch_invariant=True, async_scheduling=async_scheduling)  # fmt: skip
    return Engine(str(path), EngineConfig(**{**config, **changes}))


def serve(engine: Engine, prompts: dict, params: dict, abort_at: dict | None = None) -> tuple[dict, dict]:
    """Serve every prompt together, checking the block manager after each step: per request everything its outputs
    carried; and the step count, the steps that left one in flight, the tokens scheduled. abort_at: request id ->
    the step after which it is aborted."""
    abort_at = abort_at or {}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params[rid])
    got = {rid: {"ids": [], "text": "", "logprobs": [], "reason": None, "cached": None} for rid in prompts}
    scheduled, schedule = [0], engine.scheduler.schedule

    def counting():
        out = schedule()
        scheduled[0] += out.num_batched_tokens
        return out

    engine.scheduler.schedule = counting
    steps = in_flight = 0
    while engine.has_work():
        outputs = engine.step()
        steps += 1
        in_flight += engine.in_flight is not None
        for rid, at in abort_at.items():
            if steps == at and (last := engine.abort(rid)) is not None:
                outputs.append(last)
        for out in outputs:
            r = got[out.request_id]
            assert r["reason"] is None, f"{out.request_id}: an output after its last"
            r["ids"] += out.new_token_ids
            r["text"] += out.text
            r["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []]
            if r["cached"] is None:
                r["cached"] = out.num_cached_tokens
            if out.finished:
                r["reason"] = out.finish_reason
        engine.scheduler.block_manager.check_invariants()
    assert_all_blocks_free(engine)
    return got, {"steps": steps, "in_flight": in_flight, "scheduled": scheduled[0]}


def mixed_params(prompts: dict, greedy: dict) -> dict:
    """Greedy and seeded draws; ends by max_tokens, by a stop token (min_tokens holding back the first), with
    logprobs; penalties on one request in four (its steps are read back before the next is scheduled). greedy:
    each request's greedy tokens, where its stop tokens come from."""
    params = {}
    for i, rid in enumerate(prompts):
        stop = greedy[rid][1:4]
        kinds = [
            SamplingParams(max_tokens=5 + i % 7, temperature=0.0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i, stop_token_ids=stop),
            SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=stop, min_tokens=3),
            SamplingParams(
                max_tokens=10, temperature=0.7, seed=i, presence_penalty=0.5, repetition_penalty=1.2
            ),
        ]
        params[rid] = kinds[i % len(kinds)]
    return params


# per family: a cache small enough that requests are preempted (a hybrid's: as many sequences as the others run)
CACHE = {"llama": 36 << 10, "gemma2": 36 << 10, "qwen3_5": 300 << 10}


@pytest.mark.timeout(300)
# full attention, sliding windows, a hybrid
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_5"])
def test_async_scheduling_serves_what_steps_in_turn_serve(tiny_model_factory, family):
    path = tiny_family(tiny_model_factory, family)
    prompts = random_prompts(14, 300, seed=4, low=3, high=40)
    # a shared prefix: later requests hit blocks the earlier ones cached
    prompts.update({f"shared{i}": prompts["r0"] + [5 + i] * (3 + i) for i in range(3)})
    greedy = run(
        make_engine(path, False), prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    params = mixed_params(prompts, {rid: ids for rid, (ids, _, _) in greedy.items()})
    in_turn, in_turn_counts = serve(make_engine(path, False, kv_cache_memory=CACHE[family]), prompts, params)
    engine = make_engine(path, True, kv_cache_memory=CACHE[family])
    overlapped, counts = serve(engine, prompts, params)
    # which prefixes are cached when a request is admitted depends on when the steps before were read back
    assert without(overlapped, "cached") == without(in_turn, "cached")
    assert any(r["cached"] for r in overlapped.values()) and any(r["cached"] for r in in_turn.values())
    assert engine.stats().num_preemptions > 0 or family == "qwen3_5"
    assert {r["reason"].value for r in in_turn.values()} == {"stop", "length"}
    assert counts["in_flight"] > counts["steps"] // 2  # most steps overlapped the next
    assert in_turn_counts["in_flight"] == 0


@pytest.mark.timeout(120)
def test_a_request_is_not_computed_past_its_last_token(tiny_model_factory):
    """A request whose draw in flight is its max_tokens-th is not scheduled again: requests that end by length
    cost the tokens they cost in turn, in the same steps but the last read back."""
    path = tiny_family(tiny_model_factory, "llama")
    prompts = random_prompts(8, 300, seed=2, low=3, high=30)
    params = {
        rid: SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True)
        for i, rid in enumerate(prompts)
    }
    in_turn, in_turn_counts = serve(make_engine(path, False, max_num_seqs=8), prompts, params)
    overlapped, counts = serve(make_engine(path, True, max_num_seqs=8), prompts, params)
    assert overlapped == in_turn
    assert counts["scheduled"] == in_turn_counts["scheduled"]
    assert counts["steps"] == in_turn_counts["steps"] + 1


@pytest.mark.timeout(120)
def test_an_abort_while_its_step_runs_loses_nothing_of_the_others(tiny_model_factory):
    """Requests aborted while a step of theirs is in flight end there, with nothing after their last output; the
    others get what they get without the aborts."""
    path = tiny_family(tiny_model_factory, "llama")
    prompts = random_prompts(6, 300, seed=3, low=3, high=30)
    params = {rid: SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True) for rid in prompts}
    aborted = {"r1": 4, "r4": 7}
    in_turn, _ = serve(make_engine(path, False), prompts, params)
    engine = make_engine(path, True)
    overlapped, _ = serve(engine, prompts, params, abort_at=aborted)
    for rid in prompts:
        if rid in aborted:
            assert overlapped[rid]["reason"].value == "abort"
            assert in_turn[rid]["ids"][: len(overlapped[rid]["ids"])] == overlapped[rid]["ids"]
            assert len(overlapped[rid]["ids"]) < 16
        else:
            assert overlapped[rid] == in_turn[rid]


def test_async_scheduling_is_on_by_default_on_a_gpu_only_and_never_with_drafts(tiny_model_factory):
    path = tiny_family(tiny_model_factory, "llama")
    assert not make_engine(path, None).async_scheduling  # a CPU: each output would come a step later
    assert make_engine(path, True).async_scheduling
    with_drafts = make_engine(path, True, speculative="auto")  # batch-invariant: n-gram drafts are on
    assert with_drafts.drafter is not None and not with_drafts.async_scheduling


def without(results: dict, key: str) -> dict:
    return {rid: {k: v for k, v in r.items() if k != key} for rid, r in results.items()}
