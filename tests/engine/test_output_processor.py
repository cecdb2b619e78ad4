"""The output stage decides every finish once, carries the times and the prompt logprobs, and keeps nothing
per request once a request is over."""

import pytest

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return Engine(
        str(tiny_llama_dir), EngineConfig(kv_cache_memory=4 << 20, block_size=4, max_num_batched_tokens=64)
    )


def run(engine: Engine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


@pytest.mark.timeout(120)
def test_a_stop_string_on_the_last_allowed_token_finishes_once_as_stop(engine):
    prompt = [5, 6, 7, 8]
    free = run(engine, "free", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    text = "".join(o.text for o in free)
    assert free[-1].finish_reason == FinishReason.LENGTH and len(free) == 8
    # a stop string that only the 8th token completes: the length limit and the stop string end the same step
    last = free[-1].text
    stop = next(text[-n:] for n in range(1, len(text) + 1) if text.find(text[-n:]) == len(text) - n)
    assert stop and last, (text, last)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[stop])
    outs = run(engine, "both", prompt, params)
    assert [o.finished for o in outs] == [False] * 7 + [True]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_string == stop
    assert free[-1].stop_string is None
    assert "".join(o.text for o in outs) == text[: len(text) - len(stop)]
    assert not engine.outputs.states and not engine.scheduler.requests


@pytest.mark.timeout(120)
def test_the_last_output_carries_the_request_times(engine):
    outs = run(engine, "t", [9, 10, 11], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(o.times is None for o in outs[:-1])
    t = outs[-1].times
    assert t.arrival <= t.scheduled <= t.first_token <= t.finish


@pytest.mark.timeout(120)
def test_prompt_logprobs_come_once_even_across_chunks_and_preemption(tiny_llama_dir):
    from model.kv_cache import KVCache

    prompt = list(range(20, 60))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=True, logprobs=2)
    roomy = Engine(str(tiny_llama_dir), EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    alone = run(roomy, "p", prompt, params)
    per_block = KVCache.bytes_per_block(roomy.model_config, 4, roomy.runner.kv_cache.k.dtype)
    # 18 blocks for two requests that each grow to 17-18 blocks, in chunks of 16 tokens: one is preempted
    tight = Engine(
        str(tiny_llama_dir),
        EngineConfig(kv_cache_memory=18 * per_block, block_size=4, max_num_batched_tokens=16),
    )
    tight.add_request(
        "other", list(range(100, 140)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    )
    crowded = run(tight, "p", prompt, params)
    assert tight.stats().num_preemptions > 0
    for outs in (alone, crowded):
        with_prompt = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(with_prompt) == 1 and len(with_prompt[0]) == len(prompt)
        assert with_prompt[0][0] is None and all(
            e.token_id == t for e, t in zip(with_prompt[0][1:], prompt[1:], strict=True)
        )
    assert [o.new_token_ids for o in alone] == [o.new_token_ids for o in crowded]
    assert alone[0].prompt_logprobs == crowded[0].prompt_logprobs
    assert not tight.outputs.states and not roomy.outputs.states


@pytest.mark.timeout(120)
def test_abort_mid_prefill_leaves_nothing_behind(engine):
    params = SamplingParams(max_tokens=5, prompt_logprobs=True, logprobs=1)
    engine.add_request("a", list(range(3, 200)), params)  # longer than one step's 64 tokens
    engine.step()
    out = engine.abort("a")
    assert out.finished and out.finish_reason == FinishReason.ABORT and out.times.finish >= out.times.arrival
    assert engine.abort("a") is None
    assert not engine.outputs.states and not engine.has_work()
    assert engine.stats().kv_cache_usage == 0
