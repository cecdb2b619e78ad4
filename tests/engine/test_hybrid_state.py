"""A hybrid model's state (Gated DeltaNet layers: model/deltanet.py) where the engine goes back or ahead in a sequence.

The prefix cache, whose cached blocks are of use only with the layers' state after them: snapshots of it taken at
block boundaries (server/engine/block_manager.py). A chat's next turn resumes where the reply ended, a prefix that
requests share keeps its state from the second one on, and a request served from the cache gets the very bits it
gets computed from scratch, under eviction and preemption too.

Speculative decoding: a decode verifying drafts keeps its state after each of them, and goes back to the one after
the last draft kept; the output is plain decoding's, bit for bit.
"""

import pytest

from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig, SpeculativeConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from server.engine.request_state import Request
from tests.helpers.engine_runs import served_bits
from tests.helpers.tiny_models import tiny_family

BLOCK = 4


def make_engine(path, **changes) -> Engine:
    config = EngineConfig(kv_cache_memory=4 << 20, block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=4,
                          dtype="float32", batch_invariant=True)  # fmt: skip
    return Engine(str(path), EngineConfig(**{**config.__dict__, **changes}))


@pytest.fixture(scope="module")
def hybrid(tiny_model_factory):
    return tiny_family(tiny_model_factory, "qwen3_5")


def tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PARAMS = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2)


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams = PARAMS) -> dict[str, dict]:
    """Serve the prompts together: each one's tokens, their logprobs (the bits) and its cached prompt tokens."""
    return served_bits(engine, prompts, params)[0]


def computed(reference: Engine, prompt: list[int]) -> dict:
    """What the prompt gives computed from its first token (an engine without a prefix cache)."""
    return run(reference, {"alone": prompt})["alone"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_a_chats_next_turn_resumes_where_the_reply_ended(tiny_model_factory, family):
    """Turn 2 (turn 1's prompt and reply, then new tokens) recomputes at most its new tokens and one block, and
    gets the bits it gets from scratch; so does turn 3, past turn 2's reply. Every hybrid family."""
    path = tiny_family(tiny_model_factory, family)
    engine, reference = make_engine(path), make_engine(path, enable_prefix_caching=False)
    assert engine.config.enable_prefix_caching and engine.runner.kv_cache.num_snapshot_slots > 0
    history = tokens(37, 1)
    previous_turn = 0  # tokens of the previous turn's prompt and reply: all computed but the last
    for turn in range(3):
        result = run(engine, {f"turn{turn}": history})[f"turn{turn}"]
        alone = computed(reference, history)
        assert result["ids"] == alone["ids"] and result["logprobs"] == alone["logprobs"], turn
        assert result["cached"] >= previous_turn - BLOCK, (turn, result["cached"], previous_turn)
        previous_turn = len(history) + len(result["ids"])
        history = history + result["ids"] + tokens(9, 10 + turn)


@pytest.mark.timeout(300)
def test_a_shared_prefix_keeps_its_state_from_the_second_request_on(hybrid):
    """Three requests sharing a system prompt: the first keeps the state only at its own prompt's end, the second
    finds the shared blocks without a state, computes them, and keeps the state at their end; the third resumes
    there. Each with the bits computed from scratch."""
    engine, reference = make_engine(hybrid), make_engine(hybrid, enable_prefix_caching=False)
    system = tokens(30, 2)
    shared = len(system) // BLOCK * BLOCK
    cached = []
    for i in range(3):
        prompt = system + tokens(11, 20 + i)
        result = run(engine, {f"user{i}": prompt})[f"user{i}"]
        alone = computed(reference, prompt)
        assert result["ids"] == alone["ids"] and result["logprobs"] == alone["logprobs"], i
        cached.append(result["cached"])
    assert cached == [0, 0, shared]
    assert engine.stats().prefix_cache_hits == shared


def serve_with_a_small_cache(path, num_blocks: int, num_snapshots: int, max_tokens: int):
    """Nine requests over three shared prefixes, three at a time, on a cache of num_blocks blocks and num_snapshots
    snapshots, served twice (the second time after what the first left in the cache): each time every request's
    tokens and logprobs are those it gets alone from scratch, and every block and snapshot is accounted for after.
    Returns the engine and each round's cached prompt tokens."""
    engine = make_engine(path, max_num_seqs=3, max_num_batched_tokens=24)
    reference = make_engine(path, enable_prefix_caching=False)
    engine.scheduler.block_manager = manager = BlockManager(num_blocks, BLOCK, True, 3, num_snapshots)
    prefixes = [tokens(23, 30 + i) for i in range(3)]
    prompts = {f"r{i}": prefixes[i % 3] + tokens(5 + i, 40 + i) for i in range(9)}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = {rid: run(reference, {rid: prompt}, params)[rid] for rid, prompt in prompts.items()}
    cached = []
    for _ in range(2):
        together = run(engine, prompts, params)
        for rid in prompts:
            assert together[rid]["ids"] == alone[rid]["ids"], rid
            assert together[rid]["logprobs"] == alone[rid]["logprobs"], rid
        assert sorted(manager.free_state_slots) == [0, 1, 2]
        assert len(manager.free_snapshots) + len(manager.cached_snapshots) == num_snapshots
        cached.append([r["cached"] for r in together.values()])
    return engine, cached


@pytest.mark.timeout(600)
def test_cached_states_give_the_same_bits_under_eviction(hybrid):
    """Room for ten snapshots, fewer than the requests' prompts and replies take: some are evicted, the hits that
    remain give the bits computed from scratch."""
    _, cached = serve_with_a_small_cache(hybrid, num_blocks=64, num_snapshots=10, max_tokens=30)
    assert sum(map(sum, cached)) > 0, cached


@pytest.mark.timeout(600)
def test_cached_states_give_the_same_bits_under_preemption(hybrid):
    """Blocks for fewer than three replies at once: requests are preempted and recomputed (from a snapshot where
    one is left), with the bits computed from scratch."""
    engine, _ = serve_with_a_small_cache(hybrid, num_blocks=30, num_snapshots=6, max_tokens=30)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_drafts_kept_or_rejected_leave_plain_decodings_state(hybrid, kernels):
    """Three requests decoding at once, each verifying one to three drafts a step, of which the first 0, 1 or 2
    are right (plain decoding's next tokens) and the last wrong (six a step: the cache's seven slots hold them): the state goes back to the last kept draft, and every
    request's tokens and logprobs are plain decoding's, bit for bit. (The drafts are set by hand: a tiny random
    model never repeats itself, so n-gram drafts would all be rejected.)"""
    spec = SpeculativeConfig(num_speculative_tokens=2)
    drafting = make_engine(hybrid, speculative=spec, cpu_kernels=kernels)
    plain = make_engine(hybrid, cpu_kernels=kernels)
    assert drafting.runner.kv_cache.num_draft_slots == spec.max_step_rows - 1
    prompts = {f"r{i}": tokens(20 + 3 * i, 50 + i) for i in range(3)}
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = run(plain, prompts, params)
    got = {rid: {"ids": [], "logprobs": []} for rid in prompts}
    for rid, ids in prompts.items():
        drafting.add_request(rid, ids, params)
    step = 0
    while drafting.has_work():
        for out in drafting.step():
            got[out.request_id]["ids"] += out.new_token_ids
            got[out.request_id]["logprobs"] += [(lp.logprob, lp.top) for lp in out.logprobs]
        for n, request in enumerate(drafting.scheduler.running):  # the next step's drafts
            right = alone[request.request_id]["ids"][len(request.output_token_ids) :]
            num_right = min((step + n) % 3, len(right) - 1)
            request.draft_token_ids = right[:num_right] + [(right[num_right] + 1) % 300] if right else []
        step += 1
    for rid in prompts:
        assert got[rid]["ids"] == alone[rid]["ids"] and got[rid]["logprobs"] == alone[rid]["logprobs"], rid
    stats = drafting.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.accepted_per_position.get(1, 0) > 0  # both drafts kept, some steps
    drafting.scheduler.block_manager.check_invariants()
    # drafts end at block boundaries, where the state is kept: each reply's next turn resumes at its last one
    for rid, prompt in prompts.items():
        history = prompt + alone[rid]["ids"]
        assert run(drafting, {rid: history + [7, 8, 9]}, params)[rid]["cached"] >= len(history) - BLOCK, rid


@pytest.mark.timeout(60)
def test_a_hybrid_drafts_no_more_a_step_than_it_keeps_states_for(hybrid, caplog):
    """The budget's tenth holds the drafts' states: a step's drafts are capped to what it holds, said in the log."""
    import logging

    from model.config import ModelConfig
    from model.kv_cache import KVCache

    per_state = KVCache.bytes_per_state_slot(ModelConfig.from_dir(hybrid))
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    with caplog.at_level(logging.INFO):
        engine = make_engine(hybrid, speculative=spec, kv_cache_memory=30 * per_state)
    assert engine.runner.kv_cache.num_draft_slots == 3
    assert engine.drafter.config.max_step_rows == 4 and "3 drafts a step at most" in caplog.text


def request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams())


@pytest.mark.timeout(30)
def test_a_hit_ends_at_the_deepest_block_with_a_snapshot_and_snapshots_are_evicted_lru():
    bm = BlockManager(
        num_blocks=16, block_size=4, enable_prefix_caching=True, num_state_slots=2, num_snapshots=2
    )
    a = request("a", list(range(14)))
    assert bm.allocate(a, 14) and a.state_slot == 0
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # blocks cached but no state kept: no hit, though three blocks are shared
    hit = bm.find_cached_prefix(request("probe", list(range(20))))
    assert hit.tables[0] == [] and hit.snapshot is None and hit.num_cached_blocks == 3
    first = bm.take_snapshot(a, reuse=False)
    assert first == 2  # the slots after the running sequences'
    bm.cache_snapshot(a, first, 8, decoding=False)
    hit = bm.find_cached_prefix(request("probe", list(range(20))))
    assert hit.tables[0] == a.block_tables[0][:2] and hit.snapshot == first and hit.num_cached_blocks == 3
    second = bm.take_snapshot(a, reuse=False)
    bm.cache_snapshot(a, second, 12, decoding=False)
    assert bm.find_cached_prefix(request("probe", list(range(20)))).snapshot == second
    # a hit leaves the last token to compute: a 12-token prompt resumes after 8
    assert bm.find_cached_prefix(request("probe", list(range(12)))).snapshot == first
    bm.touch_snapshot(first)  # now `second` is the least recently used: the next taken
    assert bm.take_snapshot(a, reuse=False) == second
    assert bm.find_cached_prefix(request("probe", list(range(20)))).snapshot == first
    bm.release_snapshot(second)
    bm.check_invariants()


@pytest.mark.timeout(30)
def test_a_decoding_request_keeps_only_its_latest_snapshot():
    bm = BlockManager(
        num_blocks=16, block_size=4, enable_prefix_caching=True, num_state_slots=1, num_snapshots=4
    )
    a = request("a", list(range(9)))
    assert bm.allocate(a, 16)
    at_prompt = bm.take_snapshot(a, reuse=False)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.cache_snapshot(a, at_prompt, 8, decoding=False)
    for boundary in (12, 16):
        a.output_token_ids += list(range(100 + boundary - 4, 100 + boundary))
        a.num_computed_tokens = boundary
        bm.cache_full_blocks(a)
        bm.cache_snapshot(a, bm.take_snapshot(a, reuse=True), boundary, decoding=True)
    kept = sorted(bm.hash_to_snapshot.values())
    assert len(kept) == 2 and at_prompt in kept  # the prompt's and the reply's latest
    assert len(bm.free_snapshots) == 2
    bm.free(a)
    assert len(bm.cached_snapshots) == 2  # they outlive the request
    bm.check_invariants()


@pytest.mark.timeout(120)
def test_bench_offline_counts_a_hybrids_states_with_its_kv(hybrid):
    """`kvserve bench-offline`'s kv_bytes_per_token_at_peak holds each running request's DeltaNet state beside its
    K/V: two requests of 20 tokens (22 at most with their output) hold two states."""
    from server.bench.offline import bench_offline

    engine = make_engine(hybrid, enable_prefix_caching=False)
    per_state = engine.runner.kv_cache.bytes_per_state_slot(engine.model_config)
    result = bench_offline(engine, num_requests=2, input_len=20, output_len=2, baseline_requests=0)
    assert result["kv_bytes_per_token_at_peak"] >= per_state / 22
