"""Speculative decoding changes no bit: with n-gram drafts and grammar fast-forward verified in the normal step,
every request's tokens, logprobs, text and finish are those of the plain path (the real default model)."""

import json

import pytest

from server.engine.config import EngineConfig, SpeculativeConfig
from server.engine.engine import Engine
from server.engine.request import GrammarSpec, SamplingParams

pytestmark = pytest.mark.slow

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
SOURCE = '''def block_hash(parent_hash: int, token_ids: list[int]) -> int:
    """Identity of a full block: its tokens plus, through the parent, every token before it."""
    return hash((parent_hash, tuple(token_ids)))


def num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
'''
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


def chat(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], True, None))


def run(
    engine: Engine,
    speculative: SpeculativeConfig | None,
    requests: dict[str, tuple[list[int], SamplingParams]],
):
    """Every request to its end, together; each one's (tokens, logprobs, text, finish reason)."""
    engine.reset(speculative=speculative)
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    got = {rid: ([], [], [], None) for rid in requests}
    while engine.has_work():
        for o in engine.step():
            tokens, logprobs, texts, _ = got[o.request_id]
            tokens += o.new_token_ids
            logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
            texts.append(o.text)
            if o.finished:
                got[o.request_id] = (tokens, logprobs, "".join(texts), o.finish_reason)
    return got, engine.stats()


def assert_same_with_drafts(engine: Engine, requests) -> None:
    plain, _ = run(engine, None, requests)
    drafted, stats = run(engine, SPEC, requests)
    for rid in requests:
        assert drafted[rid] == plain[rid], rid
    assert stats.num_accepted_tokens > 0, "no draft was kept: the test would show nothing"
    # the engine timed its decode-only steps, by which the drafter sized its later ones
    rows = SPEC.max_step_rows
    assert any(
        engine.drafter.costs.timed(n, k) is not None for n in range(1, rows + 1) for k in range(rows - n + 1)
    )
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    engine.scheduler.block_manager.check_invariants()


@pytest.fixture(scope="module")
def engine(default_model_dir) -> Engine:
    return Engine(str(default_model_dir), EngineConfig(kv_cache_memory=128 << 20, max_num_seqs=8))


@pytest.mark.timeout(900)
def test_greedy_and_seeded_sampling_in_a_mixed_batch(engine):
    copy = chat(engine, "Return this code unchanged, with `block_hash` renamed to `hash_block`:\n\n" + SOURCE)
    poem = chat(engine, "Write a short poem about the sea.")
    sampled = dict(temperature=0.8, top_k=40, top_p=0.9, seed=11, logprobs=3)
    requests = {
        "copy-greedy": (copy, SamplingParams(max_tokens=64, temperature=0, logprobs=2)),
        "copy-sampled": (copy, SamplingParams(max_tokens=64, **sampled)),
        "copy-penalised": (copy, SamplingParams(max_tokens=48, temperature=0.7, seed=3, frequency_penalty=0.4,
                                                presence_penalty=0.2, repetition_penalty=1.1)),
        "poem-greedy": (poem, SamplingParams(max_tokens=48, temperature=0)),
        "poem-sampled": (poem, SamplingParams(max_tokens=48, **sampled)),
        "json": (chat(engine, "Give a person as JSON."),
                 SamplingParams(max_tokens=48, temperature=0.5, seed=2,
                                grammar=engine.grammars.compile(GrammarSpec("json_schema", json.dumps(PERSON))))),
        "stops": (copy, SamplingParams(max_tokens=64, temperature=0, stop=["num_blocks"], min_tokens=8)),
    }  # fmt: skip
    assert_same_with_drafts(engine, requests)


@pytest.mark.timeout(900)
def test_alone_and_chunked(engine):
    copy = chat(engine, "Repeat this code exactly:\n\n" + SOURCE * 3)
    requests = {"alone": (copy, SamplingParams(max_tokens=64, temperature=0, logprobs=1))}
    assert_same_with_drafts(engine, requests)
    # long prompts prefilled in chunks of 32 tokens beside decodes that carry drafts
    engine.reset(max_num_batched_tokens=32)
    try:
        requests |= {
            "chunked": (copy[:-7] + copy[-7:], SamplingParams(max_tokens=40, temperature=0.9, seed=4))
        }
        assert_same_with_drafts(engine, requests)
    finally:
        engine.reset(max_num_batched_tokens=EngineConfig().max_num_batched_tokens)


@pytest.mark.timeout(900)
def test_after_preemption(default_model_dir):
    """A cache of 24 blocks of 16 tokens for four ~130-token requests: they preempt each other, and drafts
    take slots only where they are free."""
    block_bytes = 30 * 2 * 16 * 3 * 64 * 2  # layers x (K, V) x tokens x KV heads x head dim x bfloat16
    engine = Engine(str(default_model_dir), EngineConfig(kv_cache_memory=24 * block_bytes, max_num_seqs=4))
    prompt = chat(engine, "Repeat exactly: " + SOURCE[:180])
    requests = {
        f"r{i}": (prompt, SamplingParams(max_tokens=40, temperature=0.6 * (i % 2), seed=i)) for i in range(4)
    }
    plain, plain_stats = run(engine, None, requests)
    drafted, stats = run(engine, SPEC, requests)
    assert drafted == plain
    assert plain_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert stats.num_accepted_tokens > 0


def test_auto_drafts_only_where_steps_are_batch_invariant(default_model_dir, tiny_llama_dir):
    """--speculative-config's default, "auto": drafts for the default model on CPU (its quantized GEMMs and the
    attention kernel give a token the same bits in any batch), none where a step's float32 GEMMs and attention
    are left unpadded (a draft could then change the output)."""
    on = Engine(str(default_model_dir), EngineConfig(kv_cache_memory=32 << 20, speculative="auto"))
    assert on.runner.batch_invariant
    assert on.config.speculative == SpeculativeConfig() and on.drafter is not None
    off = Engine(str(tiny_llama_dir), EngineConfig(kv_cache_memory=32 << 20, speculative="auto", dtype="float32",
                                                   batch_invariant=False, cpu_kernels="off"))  # fmt: skip
    assert not off.runner.batch_invariant
    assert off.config.speculative is None and off.drafter is None
