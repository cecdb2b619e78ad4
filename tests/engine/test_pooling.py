"""Prefill-only requests (embeddings, reranker scores) in the engine: their vectors against transformers' float32
on tiny Qwen3-Embedding- and Qwen3-Reranker-shaped models, the same whatever shares their steps, batched with
generating requests under one token budget, prefix-cached, and no block kept once they end."""

import shutil

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.pooling import select_task
from server.engine.request import FinishReason, Pooling, PoolingParams, SamplingParams
from tests.helpers.engine_runs import assert_all_blocks_free, random_prompts
from tests.helpers.pooling_models import QUERY_PROMPT, make_embedder, make_reranker, strip_to_backbone
from tests.helpers.tiny_models import FAMILY_OVERRIDES
from weights.gguf_source import GGUFSource

POOLINGS = {"lasttoken": Pooling.LAST, "mean_tokens": Pooling.MEAN, "cls_token": Pooling.CLS}


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_factory):
    return tiny_model_factory("qwen3", **FAMILY_OVERRIDES["qwen3"])


@pytest.fixture(scope="module")
def embedder_dir(qwen3_dir, tmp_path_factory):
    return make_embedder(qwen3_dir, tmp_path_factory.mktemp("st") / "tiny-qwen3-embedding")


@pytest.fixture(scope="module")
def reranker_dir(qwen3_dir, tmp_path_factory):
    return make_reranker(qwen3_dir, tmp_path_factory.mktemp("rr") / "tiny-qwen3-reranker")


def engine_for(model, **config) -> Engine:
    defaults = dict(
        kv_cache_memory=4 << 20,
        block_size=4,
        max_num_batched_tokens=64,
        dtype="float32",
        kv_cache_dtype="float32",
    )
    model = model if isinstance(model, GGUFSource) else str(model)
    return Engine(model, EngineConfig(**{**defaults, **config}))


def pooled(
    engine: Engine, prompts: dict[str, list[int]], params: PoolingParams, generate=(), max_tokens: int = 8
) -> dict:
    """Run the prompts as prefill-only requests (after `generate`'s, greedy ones of max_tokens, alongside); their
    vectors."""
    for rid, ids in dict(generate).items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    vectors = {}
    while engine.has_work():
        for out in engine.step():
            if out.pooled is not None:
                assert out.finished and out.finish_reason is FinishReason.STOP and not out.new_token_ids
                vectors[out.request_id] = torch.tensor(out.pooled)
    return vectors


def reference_pooled(path, ids: list[int], pooling: Pooling) -> torch.Tensor:
    """transformers' float32 Qwen3Model (AutoModel: the checkpoint without its LM head): its last hidden state
    (the final norm's output), pooled."""
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return {Pooling.LAST: hidden[-1], Pooling.MEAN: hidden.mean(0), Pooling.CLS: hidden[0]}[pooling]


def test_sentence_transformers_files_choose_pooling_and_prompts(
    embedder_dir, qwen3_dir, reranker_dir, tiny_model_factory
):
    task = select_task(str(embedder_dir))
    assert (task.task, task.pooling, task.normalize) == ("embed", Pooling.LAST, True)
    assert task.prompts["query"] == QUERY_PROMPT
    assert select_task(str(qwen3_dir)).task == "generate"
    assert select_task(str(qwen3_dir), pooling="mean").pooling is Pooling.MEAN
    assert select_task(str(embedder_dir), pooling="cls").pooling is Pooling.CLS  # the flag wins
    assert select_task(str(reranker_dir)).task == "score"
    assert select_task(str(reranker_dir), task="generate").task == "generate"
    llama = tiny_model_factory("llama")
    named = llama.parent / "tiny-llama-reranker"
    if not named.exists():
        shutil.copytree(llama, named)
    assert select_task(str(named)).task == "generate"  # not Qwen3-Reranker's kind: scored only if asked
    assert select_task(str(named), task="rerank").task == "score"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("pooling", list(POOLINGS.values()))
def test_vectors_match_transformers_float32(qwen3_dir, pooling, kernels):
    """Chunked over several steps (budget 16, prompts up to 60 tokens), cosine >= 0.99999."""
    engine = engine_for(qwen3_dir, cpu_kernels=kernels, max_num_batched_tokens=16)
    prompts = random_prompts(4, engine.vocab_size, seed=3, low=5, high=60)
    vectors = pooled(engine, prompts, PoolingParams(pooling))
    for rid, ids in prompts.items():
        ref = reference_pooled(qwen3_dir, ids, pooling)
        cosine = torch.nn.functional.cosine_similarity(vectors[rid], ref, dim=0).item()
        assert cosine >= 0.99999, (rid, cosine)
        assert torch.allclose(vectors[rid], ref, atol=1e-4, rtol=1e-4)
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pooling", [Pooling.LAST, Pooling.MEAN])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vector_does_not_depend_on_its_batch(qwen3_dir, pooling, async_scheduling):
    """Alone, or chunked among other embeddings and generating requests: the same bits (bfloat16 with the
    kernels, the CPU default, whose rows are batch-invariant); under async scheduling too, where a request whose
    last chunk is in flight is not scheduled again."""
    engine = engine_for(qwen3_dir, dtype="bfloat16", kv_cache_dtype="bfloat16", max_num_batched_tokens=24,
                        async_scheduling=async_scheduling)  # fmt: skip
    prompts = random_prompts(6, engine.vocab_size, seed=5, low=5, high=50)
    others = random_prompts(4, engine.vocab_size, seed=6, prefix="g")
    together = pooled(engine, prompts, PoolingParams(pooling), generate=others)
    for rid, ids in prompts.items():
        engine.reset()  # a fresh prefix cache: nothing alone is served from what ran together
        alone = pooled(engine, {rid: ids}, PoolingParams(pooling))[rid]
        assert torch.equal(alone, together[rid]), rid
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
def test_batched_with_generation_under_one_budget_and_prefix_cached(qwen3_dir):
    engine = engine_for(qwen3_dir, max_num_batched_tokens=16)
    shared = list(range(10, 42))  # 8 blocks of 4
    prompts = {f"e{i}": shared + [50 + i, 60 + i] for i in range(3)}
    generating = random_prompts(2, engine.vocab_size, seed=9, prefix="g")
    for rid, ids in generating.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.add_request("e0", prompts["e0"], PoolingParams())
    mixed_steps, outputs = 0, {}
    while engine.has_work():
        scheduled = engine.scheduler.schedule()
        assert scheduled.num_batched_tokens <= 16
        kinds = {c.pool for c in scheduled.chunks}
        mixed_steps += kinds == {True, False}
        computed = engine.runner.execute(scheduled)
        step_outputs, finished = engine.outputs.process(scheduled, computed)
        engine.scheduler.update(scheduled, {o.request_id: o.new_token_ids for o in step_outputs}, finished)
        outputs.update({o.request_id: o for o in step_outputs if o.finished})
        if "e0" in outputs and "e1" not in engine.scheduler.requests and "e1" not in outputs:
            for rid in ("e1", "e2"):  # after e0 finished: its blocks are free but cached
                engine.add_request(rid, prompts[rid], PoolingParams())
    assert mixed_steps > 0
    assert outputs["e0"].num_cached_tokens == 0
    assert outputs["e1"].num_cached_tokens == outputs["e2"].num_cached_tokens == 32
    assert engine.stats().num_pooled_requests == 3
    assert engine.stats().num_generation_tokens == 24
    assert_all_blocks_free(engine)


@pytest.mark.timeout(300)
def test_reranker_logits_match_transformers(reranker_dir):
    """The [no, yes] logits at the last position, as Qwen3-Reranker's card reads them, within 1e-4."""
    import transformers

    engine = engine_for(reranker_dir, max_num_batched_tokens=16)
    assert engine.task.task == "score"
    yes, no = engine.tokenizer.encode("yes"), engine.tokenizer.encode("no")
    assert len(yes) == len(no) == 1
    prompts = random_prompts(3, 300, seed=11, low=5, high=40)
    vectors = pooled(engine, prompts, PoolingParams(logit_token_ids=(no[0], yes[0])))
    model = transformers.AutoModelForCausalLM.from_pretrained(reranker_dir, dtype=torch.float32).eval()
    for rid, ids in prompts.items():
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        ref = logits[[no[0], yes[0]]]
        assert torch.allclose(vectors[rid], ref, atol=1e-4), (vectors[rid], ref)
        score = torch.softmax(vectors[rid], 0)[1]
        assert abs(score - torch.softmax(ref, 0)[1]) < 1e-4


@pytest.mark.timeout(300)
def test_a_backbone_only_checkpoint_as_qwen3_embedding_ships(tiny_model_factory, tmp_path):
    """Qwen3-Embedding-0.6B's files: flat backbone names, no LM head (tied), sentence-transformers' modules."""
    tied = tiny_model_factory("qwen3", head_dim=32, tie_word_embeddings=True)
    folder = strip_to_backbone(make_embedder(tied, tmp_path / "Qwen3-Embedding-tiny"))
    engine = engine_for(folder)
    assert engine.task.task == "embed" and engine.task.pooling is Pooling.LAST
    prompts = random_prompts(2, engine.vocab_size, seed=4)
    vectors = pooled(engine, prompts, PoolingParams())
    for rid, ids in prompts.items():
        ref = reference_pooled(tied, ids, Pooling.LAST)
        assert torch.nn.functional.cosine_similarity(vectors[rid], ref, dim=0).item() >= 0.99999
    engine.validate([5, 6], SamplingParams())  # tied: the head is there, it generates


@pytest.mark.timeout(300)
def test_an_untied_checkpoint_without_its_head_embeds_and_refuses_to_generate(qwen3_dir, tmp_path):
    """Qwen3-Embedding-8B's files: untied in config.json, yet no LM head in the checkpoint."""
    folder = strip_to_backbone(make_embedder(qwen3_dir, tmp_path / "Qwen3-Embedding-untied"))
    engine = engine_for(folder)
    assert not engine.model_config.has_lm_head
    prompts = random_prompts(2, engine.vocab_size, seed=7)
    vectors = pooled(engine, prompts, PoolingParams())
    for rid, ids in prompts.items():
        ref = reference_pooled(qwen3_dir, ids, Pooling.LAST)
        assert torch.nn.functional.cosine_similarity(vectors[rid], ref, dim=0).item() >= 0.99999
    with pytest.raises(ValueError, match="no LM head"):
        engine.validate([5, 6], SamplingParams())


@pytest.mark.timeout(300)
def test_a_gguf_embedder_pools_as_its_pooling_type(tmp_path):
    """A tiny Qwen3 written to GGUF as llama.cpp's converter writes Qwen3-Embedding (pooling_type 3, last), served
    from the file in place: the same vectors as transformers' on the folder it came from."""
    from tests.helpers.gguf_writers import byte_level_vocab, tiny_hf_model, write_llama_cpp_gguf

    vocab = byte_level_vocab("qwen2")
    tiny_hf_model("qwen3", len(vocab["tokens"])).save_pretrained(tmp_path / "hf")
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "embed.gguf", vocab, pooling_type=3)
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "rank.gguf", vocab, pooling_type=4)
    assert select_task(GGUFSource(tmp_path / "rank.gguf")).task == "score"
    engine = engine_for(GGUFSource(tmp_path / "embed.gguf"), quantization="none")
    assert (engine.task.task, engine.task.pooling, engine.task.normalize) == ("embed", Pooling.LAST, True)
    prompts = random_prompts(3, engine.vocab_size, seed=8, low=5, high=40)
    vectors = pooled(engine, prompts, PoolingParams())
    for rid, ids in prompts.items():
        ref = reference_pooled(tmp_path / "hf", ids, Pooling.LAST)
        assert torch.nn.functional.cosine_similarity(vectors[rid], ref, dim=0).item() >= 0.99999
        assert torch.allclose(vectors[rid], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(300)
def test_a_gguf_reranker_scores_as_transformers(tmp_path):
    """A tiny Qwen3 written to GGUF as a reranker (pooling_type 4, rank) and served from the file: its logits of
    two tokens at the last position (the card's "no" and "yes"), and their softmax, as transformers' on the folder
    it came from."""
    import transformers

    from tests.helpers.gguf_writers import byte_level_vocab, tiny_hf_model, write_llama_cpp_gguf

    vocab = byte_level_vocab("qwen2")
    tiny_hf_model("qwen3", len(vocab["tokens"])).save_pretrained(tmp_path / "hf")
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "rank.gguf", vocab, pooling_type=4)
    engine = engine_for(GGUFSource(tmp_path / "rank.gguf"), quantization="none", max_num_batched_tokens=16)
    assert engine.task.task == "score"
    no, yes = 78, 121  # "n" and "y": byte-level tokens
    prompts = random_prompts(3, engine.vocab_size, seed=12, low=5, high=40)
    scores = pooled(engine, prompts, PoolingParams(logit_token_ids=(no, yes)))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for rid, ids in prompts.items():
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1][[no, yes]]
        assert torch.allclose(scores[rid], ref, atol=1e-4), (scores[rid], ref)
        assert abs(torch.softmax(scores[rid], 0)[1] - torch.softmax(ref, 0)[1]) < 1e-4


@pytest.mark.timeout(300)
def test_preempted_and_aborted_prefill_only_requests(qwen3_dir):
    """A cache too small for the generating requests beside them: prefills are preempted (the newest running
    request goes first) and recomputed, and each mean vector comes out as it does alone; a request aborted
    mid-prefill gives no vector and keeps no block."""
    # 40 blocks of 4 tokens: 2 layers x K and V x 4 tokens x 2 heads x 32 dims x 4 bytes a block
    engine = engine_for(qwen3_dir, kv_cache_memory=40 * 2 * 2 * 4 * 2 * 32 * 4, max_num_batched_tokens=16)
    assert engine.runner.num_blocks == 40
    prompts = random_prompts(4, engine.vocab_size, seed=12, low=50, high=60)  # ~14 blocks each
    generating = random_prompts(3, engine.vocab_size, seed=13, low=20, high=20, prefix="g")  # 25 blocks each
    seen_preempted = set()
    step = engine.step

    def step_and_watch():
        outputs = step()
        seen_preempted.update(r.request_id for r in engine.scheduler.waiting if r.num_preemptions)
        return outputs

    engine.step = step_and_watch
    together = pooled(engine, prompts, PoolingParams(Pooling.MEAN), generate=generating, max_tokens=80)
    del engine.step
    assert seen_preempted & set(prompts), seen_preempted
    for rid, ids in prompts.items():
        engine.reset()
        assert torch.equal(pooled(engine, {rid: ids}, PoolingParams(Pooling.MEAN))[rid], together[rid])
    engine.add_request("gone", prompts["r0"], PoolingParams())
    engine.step()
    assert engine.abort("gone").pooled is None
    assert_all_blocks_free(engine)


def test_prefill_only_requests_fit_the_whole_context(qwen3_dir):
    engine = engine_for(qwen3_dir, max_model_len=32)
    engine.validate(list(range(3, 35)), PoolingParams())  # 32 tokens: the whole context, nothing drawn
    with pytest.raises(ValueError, match="exceeds the maximum context length"):
        engine.validate(list(range(3, 36)), PoolingParams())
