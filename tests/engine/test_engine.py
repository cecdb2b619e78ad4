import random

import pytest

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import FinishReason, RequestError, RequestOutput, SamplingParams, TokenLogprob
from tests.helpers.engine_runs import GREEDY, alone, assert_all_blocks_free, random_prompts, run


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_llama_dir):
    def make(**kw) -> Engine:
        config = dict(kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=64)
        config.update(kw)
        return Engine(str(tiny_llama_dir), EngineConfig(**config))

    return make


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_batched_greedy_equals_alone(default_model_dir):
    """16 prompts together (chunked, mixed with decodes) give each prompt's tokens alone, bit for bit."""
    engine = Engine(
        str(default_model_dir), EngineConfig(kv_cache_memory=256 << 20, max_num_batched_tokens=48)
    )
    tok = engine.tokenizer
    questions = [
        "What is the capital of France?", "Write a haiku about rain.", "Name three prime numbers.",
        "How do plants make food?", "Translate 'good morning' to Spanish.", "What is 12 times 12?",
        "Give me a synonym for happy.", "Who wrote Hamlet?", "What is the boiling point of water?",
        "List two colors of the rainbow.", "Why is the sky blue?", "What does a CPU do?",
        "Describe a cat in one sentence.", "What is the largest ocean?", "Say hello in German.",
        "What is Python used for?",
    ]  # fmt: skip
    prompts = {
        f"q{i}": tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
        for i, q in enumerate(questions)
    }
    params = SamplingParams(max_tokens=20, temperature=0.0)
    together = run(engine, prompts, params)
    assert engine.stats().num_steps > 0
    one_by_one = alone(engine, prompts, params)
    assert together == one_by_one
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,batch_invariant", [("bfloat16", None), ("float32", True)])  # None: default
@pytest.mark.parametrize("kernels", ["on", "off"])  # the C++ CPU kernels, PyTorch ops
def test_batched_equals_alone_with_chunking(tiny_engine_factory, dtype, batch_invariant, kernels):
    engine = tiny_engine_factory(
        dtype=dtype, batch_invariant=batch_invariant, max_num_batched_tokens=24, cpu_kernels=kernels
    )
    from model.attention_cpu import CpuKernelAttention

    assert isinstance(engine.runner.attention, CpuKernelAttention) == (kernels == "on")
    prompts = random_prompts(16, engine.vocab_size)
    assert run(engine, prompts) == alone(engine, prompts)
    assert_all_blocks_free(engine)


@pytest.mark.timeout(120)
def test_batch_invariance_is_on_by_default_in_bfloat16_only(tiny_engine_factory, monkeypatch):
    import model.invariance
    from model.linear import Linear

    # a CPU on which every GEMM needs 6 rows: what the engine pads then shows whether it calibrated
    monkeypatch.setattr(model.invariance, "rows_for_invariance", lambda fn, x: 6)

    def padding(engine):
        m = engine.runner.model
        return {
            x.min_rows for x in m.modules() if isinstance(x, Linear)
        }, engine.runner.attention.min_query_len

    heads_per_kv = 2  # the tiny model: 4 query heads, 2 KV heads
    on = ({6}, 6 // heads_per_kv)
    torch_path = {"cpu_kernels": "off"}  # the C++ attention kernel needs no query padding
    assert padding(tiny_engine_factory(dtype="bfloat16", **torch_path)) == on
    assert padding(tiny_engine_factory(dtype="bfloat16")) == ({6}, 1)
    assert padding(tiny_engine_factory(dtype="float32", batch_invariant=True, **torch_path)) == on
    assert padding(tiny_engine_factory(dtype="bfloat16", batch_invariant=False, **torch_path)) == ({1}, 1)
    assert padding(tiny_engine_factory(dtype="float32", **torch_path)) == ({1}, 1)


@pytest.mark.timeout(300)
def test_seeded_sampling_is_independent_of_the_batch(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = random_prompts(8, engine.vocab_size, seed=3)
    params = {
        rid: SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1000 + i)
        for i, rid in enumerate(prompts)
    }
    together = run(engine, prompts, params)
    assert together == alone(engine, prompts, params)
    assert len({tuple(t) for t, _, _ in together.values()}) == len(prompts)


@pytest.mark.timeout(300)
def test_fragmented_free_list_gives_the_same_output(tiny_engine_factory):
    prompts = random_prompts(4, 300, seed=5)
    contiguous = alone(tiny_engine_factory(), prompts)
    engine = tiny_engine_factory()
    # scatter the free list: admit many requests of mixed sizes and abort every other one mid-flight
    noise = random_prompts(12, engine.vocab_size, seed=9, low=5, high=40, prefix="noise")
    for rid, ids in noise.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=8, temperature=0.0))
    for _ in range(3):
        engine.step()
    for rid in list(noise)[::2]:
        engine.abort(rid)
    engine.step()
    tables_before = [list(r.block_tables[0]) for r in engine.scheduler.running]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables_before if t)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    tokens = {rid: [] for rid in prompts}
    while engine.has_work():
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
    assert {rid: r[0] for rid, r in contiguous.items()} == tokens
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
def test_preemption_completes_every_request_correctly(tiny_engine_factory):
    from model.kv_cache import KVCache

    probe = tiny_engine_factory()
    per_block = KVCache.bytes_per_block(probe.model_config, 4, probe.runner.kv_cache.k.dtype)
    prompts = random_prompts(8, probe.vocab_size, seed=11, low=20, high=30)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = alone(probe, prompts, params)
    # 40 blocks of 4 tokens: room for ~2-3 of the 8 requests (each needs up to 18 blocks) at once
    engine = tiny_engine_factory(kv_cache_memory=40 * per_block)
    got = run(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    assert got == expected
    assert all(len(t) == 40 and r == FinishReason.LENGTH for t, _, r in got.values())
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
def test_abort_frees_everything(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompts = random_prompts(10, engine.vocab_size, seed=13)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    outputs = [engine.abort(rid) for rid in prompts]
    assert all(o.finished and o.finish_reason == FinishReason.ABORT for o in outputs)
    assert not engine.has_work()
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
def test_shared_system_prompt_hits_the_prefix_cache(tiny_engine_factory):
    vocab = 300
    rng = random.Random(17)
    system = [rng.randrange(3, vocab) for _ in range(64)]
    prompts = {f"u{i}": system + [rng.randrange(3, vocab) for _ in range(10 + i)] for i in range(6)}
    cached = tiny_engine_factory()
    uncached = tiny_engine_factory(enable_prefix_caching=False)
    first = next(iter(prompts))
    # the first request fills the cache; the others each find the 64 shared tokens (16 full blocks)
    out_cached = run(cached, {first: prompts[first]}) | run(
        cached, {k: v for k, v in prompts.items() if k != first}
    )
    out_uncached = run(uncached, prompts)
    assert out_cached == out_uncached
    stats = cached.stats()
    assert stats.prefix_cache_hits == 64 * (len(prompts) - 1)
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts.values())
    assert uncached.stats().prefix_cache_hits == 0
    assert_all_blocks_free(cached)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_string_spanning_tokens_is_cut(default_model_dir):
    # the float32 answer ("The capital of France is Paris."), on every tier: int8 activations tip its first token
    config = EngineConfig(kv_cache_memory=64 << 20, dtype="float32", gemm_activations="wide")
    engine = Engine(str(default_model_dir), config)
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    full = run(engine, {"a": prompt}, SamplingParams(max_tokens=12, temperature=0.0))["a"][1]
    assert "capital of France" in full
    # "l of Fr" starts inside one token and ends inside another
    ids = tok.encode(full)
    pieces = [tok.decode([i]) for i in ids]
    assert not any("l of Fr" in p for p in pieces)
    tokens, text, reason = run(
        engine, {"b": prompt}, SamplingParams(max_tokens=12, temperature=0.0, stop=["l of Fr"])
    )["b"]
    assert text == full[: full.index("l of Fr")]
    assert reason == FinishReason.STOP
    _, text2, _ = run(
        engine,
        {"c": prompt},
        SamplingParams(max_tokens=12, temperature=0.0, stop=["l of Fr"], include_stop_str_in_output=True),
    )["c"]
    assert text2 == full[: full.index("l of Fr") + len("l of Fr")]
    assert_all_blocks_free(engine)


@pytest.mark.timeout(120)
def test_requests_that_can_never_fit_are_refused(tiny_engine_factory):
    engine = tiny_engine_factory(max_model_len=64)
    with pytest.raises(ValueError, match="64"):
        engine.add_request("big", list(range(3, 60)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("t", [5, 6], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("v", [5, 100000], SamplingParams())
    assert not engine.has_work()


@pytest.mark.timeout(120)
def test_async_engine_builds_on_its_stepping_thread(tiny_engine_factory):
    import asyncio
    import threading

    from server.engine.async_engine import AsyncEngine

    def failing():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(failing)

    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return tiny_engine_factory()

    async def one_request(engine: AsyncEngine) -> list[int]:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        return [t async for out in engine.generate("r", [5, 6, 7], params) for t in out.new_token_ids]

    from_factory, prebuilt = AsyncEngine(build), AsyncEngine(tiny_engine_factory())
    try:
        assert built_on == [from_factory._thread]
        assert asyncio.run(one_request(from_factory)) == asyncio.run(one_request(prebuilt))
        assert len(asyncio.run(one_request(prebuilt))) == 5
    finally:
        from_factory.shutdown()
        prebuilt.shutdown()


@pytest.mark.timeout(120)
def test_latencies_count_the_wait_for_the_step_in_progress(tiny_engine_factory):
    """A request that arrives while a step runs waits for that step to end before the stepping thread takes it
    in: its queue time and TTFT count that wait, from the moment it was handed to the engine (one clock)."""
    import asyncio
    import threading
    import time

    from server.engine.async_engine import AsyncEngine

    engine = tiny_engine_factory()
    held, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():  # the first step blocks until the test lets it go, as a long prefill would
        if not held.is_set():
            held.set()
            release.wait(10)
        return step()

    engine.step = held_step
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    async def scenario():
        first = async_engine.generate("first", [5, 6, 7], params)
        await asyncio.to_thread(held.wait, 10)
        handed_over = time.monotonic()
        second = async_engine.generate("second", [8, 9, 10], params)
        await asyncio.sleep(0.5)  # the step in progress holds the second request in the inbox
        release.set()
        outs = [o async for o in first] + [o async for o in second]
        return handed_over, [o.times for o in outs if o.finished]

    try:
        handed_over, (_, times) = asyncio.run(scenario())
    finally:
        release.set()
        async_engine.shutdown()
    assert 0 <= times.arrival - handed_over < 0.05
    assert times.scheduled - times.arrival >= 0.5
    assert times.first_token - times.arrival >= 0.5


def test_outputs_a_consumer_has_not_taken_go_out_as_one_delta():
    from server.engine.async_engine import mergeable, merged

    def out(ids, text, marks=(), finished=False, error=None, lp=True, prompt_lp=None):
        logprobs = [TokenLogprob(t, -1.0, []) for t in ids] if lp else None
        return RequestOutput("r", list(ids), text, finished, FinishReason.LENGTH if finished else None,
                             num_output_tokens=ids[-1], logprobs=logprobs, prompt_logprobs=prompt_lp,
                             error=error, marks=list(marks))  # fmt: skip

    first, second = out([1, 2], "ab", [(1, 2)], prompt_lp=[None]), out([3], "cd", [(0, 3)], finished=True)
    both = merged(first, second)
    assert (both.new_token_ids, both.text, both.marks) == ([1, 2, 3], "abcd", [(1, 2), (2, 3)])
    assert [lp.token_id for lp in both.logprobs] == [1, 2, 3] and both.prompt_logprobs == [None]
    assert (both.finished, both.finish_reason, both.num_output_tokens) == (True, FinishReason.LENGTH, 3)
    assert merged(out([1], "a", lp=False), out([2], "b", lp=False)).logprobs is None
    assert mergeable(first, second) and not mergeable(second, out([4], "e"))  # nothing after the end
    assert not mergeable(first, out([3], "", error=RequestError("grammar")))  # the text before goes first


@pytest.mark.timeout(120)
def test_a_consumer_behind_the_steps_takes_their_outputs_merged(tiny_engine_factory):
    """A stream not read while the engine steps gets, when read, what those steps made in one delta (as vLLM's
    output collector): the same tokens, text and logprobs as a stream read step by step."""
    import asyncio
    import time

    from server.engine.async_engine import AsyncEngine

    async_engine = AsyncEngine(tiny_engine_factory())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)

    async def outputs(request_id: str, wait: bool) -> list[RequestOutput]:
        stream = async_engine.generate(request_id, [5, 6, 7], params)
        if wait:  # until the engine is done with it, reading nothing
            deadline = time.monotonic() + 30
            while async_engine.stats().num_generation_tokens < 24 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        return [o async for o in stream]

    try:
        read_along = asyncio.run(outputs("along", False))
        read_late = asyncio.run(outputs("late", True))
    finally:
        async_engine.shutdown()
    assert len(read_late) == 1 < len(read_along)
    late = read_late[0]
    assert (
        late.new_token_ids == [t for o in read_along for t in o.new_token_ids]
        and len(late.new_token_ids) == 12
    )
    assert late.text == "".join(o.text for o in read_along)
    assert [lp.token_id for lp in late.logprobs] == late.new_token_ids
    assert late.finished and late.finish_reason == FinishReason.LENGTH and late.num_output_tokens == 12
