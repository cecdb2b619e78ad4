"""/v1/embeddings, /v1/rerank (and /rerank) and /v1/score on tiny Qwen3-Embedding- and Qwen3-Reranker-shaped
models, through real clients (the openai SDK, LangChain's OpenAIEmbeddings, httpx), and bad input refused with a
clear 400 in OpenAI's error shape, never a 500, while other requests carry on."""

import asyncio
import base64
import importlib
import json
import math
import struct
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from server.api.scoring import DEFAULT_INSTRUCTION, PREFIX, SUFFIX
from tests.api.conftest import make_engine
from tests.helpers.pooling_models import QUERY_PROMPT, make_embedder, make_reranker
from tests.helpers.tiny_models import FAMILY_OVERRIDES

pytestmark = pytest.mark.timeout(120)
MODEL = "test-model"
DOCS = ["The capital of China is Beijing.", "Gravity pulls bodies together.", "Paris is in France."]


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_factory):
    return tiny_model_factory("qwen3", **FAMILY_OVERRIDES["qwen3"])


@pytest.fixture(scope="module")
def embedder(qwen3_dir, tmp_path_factory):
    path = make_embedder(qwen3_dir, tmp_path_factory.mktemp("api-st") / "tiny-qwen3-embedding")
    engine = make_engine(path, max_model_len=128)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def long_qwen3_dir(tiny_model_factory):
    """Byte-level tokens: the reranker's prompt alone is ~250 of them."""
    return tiny_model_factory("qwen3", **FAMILY_OVERRIDES["qwen3"], max_position_embeddings=1024)


@pytest.fixture(scope="module")
def reranker(long_qwen3_dir, tmp_path_factory):
    path = make_reranker(long_qwen3_dir, tmp_path_factory.mktemp("api-rr") / "tiny-qwen3-reranker")
    engine = make_engine(path)
    yield engine
    engine.shutdown()


@pytest.fixture
def embed_url(start_server, embedder):
    return start_server(embedder)[0]


@pytest.fixture
def rerank_url(start_server, reranker):
    return start_server(reranker)[0]


def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_openai_sdk_floats_and_base64(embed_url):
    c = client(embed_url)
    floats = c.embeddings.create(model=MODEL, input=["hello there", "the cat"], encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL and [d.index for d in floats.data] == [0, 1]
    assert all(abs(norm(d.embedding) - 1) < 1e-5 for d in floats.data)  # the model normalises
    assert len(floats.data[0].embedding) == 64 and floats.data[0].embedding != floats.data[1].embedding
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    default = c.embeddings.create(model=MODEL, input=["hello there", "the cat"])  # the SDK asks for base64
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    raw = httpx.post(
        f"{embed_url}/v1/embeddings", json={"input": "hello there", "encoding_format": "base64"}
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(
        floats.data[0].embedding, abs=1e-7
    )


def test_token_ids_dimensions_and_prompt_name(embed_url, embedder):
    c = client(embed_url)
    text = "hello there"
    ids = embedder.tokenizer.encode(text, add_special_tokens=True)
    by_text = c.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
    by_ids = c.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding
    several = c.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float").data
    assert by_ids == by_text == several[0].embedding and several[1].embedding != by_text
    short = (
        c.embeddings.create(model=MODEL, input=text, dimensions=16, encoding_format="float").data[0].embedding
    )
    assert len(short) == 16 and abs(norm(short) - 1) < 1e-6
    head = by_text[:16]  # Matryoshka: the first values, normalised again
    assert short == pytest.approx([x / norm(head) for x in head], abs=1e-6)
    query = c.embeddings.create(
        model=MODEL, input=text, encoding_format="float", extra_body={"prompt_name": "query"}
    )
    with_prompt = c.embeddings.create(model=MODEL, input=QUERY_PROMPT + text, encoding_format="float")
    assert query.data[0].embedding == with_prompt.data[0].embedding != by_text


def test_langchain_sends_token_ids(embed_url, embedder, monkeypatch):
    """OpenAIEmbeddings tokenizes with tiktoken and sends the ids. tiktoken's files are downloaded, and a test has
    no network: an encoding of this model's byte tokens stands in, so the ids it sends are this model's."""
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    tokenizer = embedder.tokenizer
    ranks = {
        bytes([b]): tokenizer.encode(bytes([b]).decode("latin-1"))[0] for b in range(ord(" "), ord("z") + 1)
    }
    encoding = tiktoken.Encoding("tiny-bytes", pat_str=r"[\s\S]", mergeable_ranks=ranks, special_tokens={})
    monkeypatch.setattr(tiktoken, "encoding_for_model", lambda name: encoding)
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: encoding)
    sent = []
    recording = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.read())]})
    lc = OpenAIEmbeddings(model=MODEL, base_url=f"{embed_url}/v1", api_key="unused", http_client=recording)
    vectors = lc.embed_documents(["hello there", "the cat"])
    assert b'"input":[[' in sent[0]  # token ids, not text
    ids = [encoding.encode_ordinary(t) for t in ("hello there", "the cat")]
    direct = client(embed_url).embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    assert vectors == [pytest.approx(d.embedding, abs=1e-6) for d in direct]
    assert lc.embed_query("hello there") == pytest.approx(direct[0].embedding, abs=1e-6)


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "empty"),
        ({"input": ["ok", ""]}, "input[1]", "empty"),
        ({"input": ["x"] * 10_000}, "input", "at most 2048 inputs"),
        ({"input": "word " * 200}, "input", "maximum context length of 128"),
        ({"input": [[5, 6], [70000]]}, "input", "check_embedding_ctx_length=False"),
        ({"input": "a", "dimensions": 65}, "dimensions", "at most the model's 64"),
        ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "a", "prompt_name": "nope"}, "prompt_name", "query"),
        ({"input": "a", "model": "other"}, "model", "does not exist"),
        ({"input": [1.5]}, "input", ""),
        ({}, "input", "required"),
    ],
)
def test_bad_embedding_requests_are_clear_400s(embed_url, body, param, words):
    r = httpx.post(f"{embed_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error


def test_a_bad_request_loses_no_other_requests_work(embed_url):
    """Good requests running while bad ones are refused all come back whole."""
    results, c = {}, client(embed_url)

    def good(i):
        results[i] = c.embeddings.create(model=MODEL, input=[f"text {i}"] * 8, encoding_format="float")

    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(4):
        assert httpx.post(f"{embed_url}/v1/embeddings", json={"input": ["ok", ""]}).status_code == 400
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3] and all(len(r.data) == 8 for r in results.values())


def test_metrics_count_prefill_only_requests(embed_url, scrape):
    before = scrape(embed_url, idle=True)["kvserve:pooled_requests_total"]
    client(embed_url).embeddings.create(model=MODEL, input=["a", "b", "c"])
    after = scrape(embed_url, idle=True)
    assert after["kvserve:pooled_requests_total"] == before + 3
    assert after["kvserve:kv_cache_usage_perc"] == 0


def test_embedder_still_generates(embed_url):
    r = client(embed_url).completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_rerank_with_httpx(rerank_url, reranker):
    body = {"model": MODEL, "query": "What is the capital of China?", "documents": DOCS, "top_n": 2}
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(f"{rerank_url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["id"].startswith("rerank-") and out["model"] == MODEL and out["usage"]["total_tokens"] > 0
        results = out["results"]
        assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert all(0 <= x["relevance_score"] <= 1 for x in results)
        assert results[0]["document"]["text"] == DOCS[results[0]["index"]]
    scores = httpx.post(
        f"{rerank_url}/v1/score", json={"text_1": body["query"], "text_2": DOCS}, timeout=60
    ).json()
    assert [d["index"] for d in scores["data"]] == [0, 1, 2] and scores["object"] == "list"
    every = httpx.post(
        f"{rerank_url}/v1/rerank", json={**body, "top_n": None, "return_documents": False}
    ).json()
    by_index = {x["index"]: x["relevance_score"] for x in every["results"]}
    assert [by_index[i] for i in range(3)] == pytest.approx([d["score"] for d in scores["data"]], abs=1e-6)
    assert all(x.get("document") is None for x in every["results"])
    objects = httpx.post(
        f"{rerank_url}/v1/rerank", json={**body, "documents": [{"text": d} for d in DOCS]}
    ).json()
    assert objects["results"] == out["results"]


def test_rerank_pairs_share_the_prompt_and_query_through_the_prefix_cache(rerank_url, scrape):
    before = scrape(rerank_url, idle=True)["kvserve:prefix_cache_hits_total"]
    body = {"query": "Which one is new? A query no other test sends.", "documents": DOCS}
    assert httpx.post(f"{rerank_url}/v1/rerank", json=body, timeout=60).status_code == 200
    hits = scrape(rerank_url, idle=True)["kvserve:prefix_cache_hits_total"] - before
    # byte tokens: the prompt up to the document is ~300 of them; the second and third pairs find all but the
    # last partial block of it
    assert hits >= 2 * 256, hits


def test_rerank_score_is_the_model_cards(rerank_url, reranker, long_qwen3_dir):
    """Qwen3-Reranker's card: prefix, instruction/query/document, suffix tokenized apart; softmax over [no, yes]
    at the last position, against transformers' float32 on the same weights (the server runs bfloat16)."""
    import torch
    import transformers

    tok = reranker.tokenizer
    query, doc = "What is the capital of China?", DOCS[0]
    body = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
    ids = tok.encode(PREFIX) + tok.encode(body) + tok.encode(SUFFIX)
    model = transformers.AutoModelForCausalLM.from_pretrained(long_qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    no, yes = tok.encode("no")[0], tok.encode("yes")[0]
    expected = torch.softmax(logits[[no, yes]], 0)[1].item()
    r = httpx.post(f"{rerank_url}/v1/score", json={"text_1": query, "text_2": doc}).json()
    assert r["data"][0]["score"] == pytest.approx(expected, abs=2e-2)  # bfloat16 against float32
    assert r["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "path,body,param,words",
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"query": "q"}, "documents", "required"),
        ("/v1/rerank", {"query": "q", "documents": ["d"] * 3000}, "documents", "at most 2048"),
        ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", "greater than or equal"),
        ("/v1/rerank", {"query": "q " * 600, "documents": ["d"]}, "documents", "maximum context length"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "one text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2", "must not be empty"),
    ],
)
def test_bad_rerank_requests_are_clear_400s(rerank_url, path, body, param, words):
    r = httpx.post(f"{rerank_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error


def test_routes_refuse_a_model_not_served_for_them(rerank_url, embed_url):
    r = httpx.post(f"{rerank_url}/v1/embeddings", json={"input": "a"})
    assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"]
    r = httpx.post(f"{embed_url}/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "--task score" in r.json()["error"]["message"]


def test_a_drain_that_aborts_an_embedding_answers_503(
    qwen3_dir, tmp_path, new_engine, start_server, wait_for
):
    """One sequence at a time, held by a long generation: the embedding waits, the drain's timeout aborts both,
    and the embedding's client gets a 503 (no vector to send), not a 500."""
    import asyncio

    from server.api.app import drain

    model = make_embedder(qwen3_dir, tmp_path / "tiny-qwen3-embedding")
    # A generation that outlasts the drain's 0.3 s on any host: 240 tokens (the tiny model's context allowed
    # no more) took less than that on a Zen 4, which then served the embedding before the drain ended.
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    engine = new_engine(model, max_num_seqs=1)
    url, app = start_server(engine, shutdown_timeout=0.3)
    answers = []
    long = {"prompt": "hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", "/v1/completions", json=long):
        wait_for(lambda: engine.stats().num_running == 1, what="the generation running")
        waiting = threading.Thread(
            target=lambda: answers.append(http.post("/v1/embeddings", json={"input": "a"}))
        )
        waiting.start()
        wait_for(lambda: engine.stats().num_waiting == 1, what="the embedding waiting")
        asyncio.run(drain(app))
        waiting.join(10)
    assert answers[0].status_code == 503, answers[0].text
    assert "shutting down" in answers[0].json()["error"]["message"]


@pytest.fixture(scope="module")
def bench_script():
    """scripts/bench_embeddings.py, the benchmark the project ships against llama.cpp's embedding server (it
    imports its server handling from scripts/bench_full_size.py, beside it)."""
    scripts = Path(__file__).parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        yield importlib.import_module("bench_embeddings")
    finally:
        sys.path.remove(str(scripts))


def test_the_embedding_benchmark_cuts_its_texts_to_the_asked_lengths(bench_script):
    """Lengths drawn in [min, max] tokens, counted by the tokenizer it is given (here one where long words are
    two tokens), and the same texts for the same seed."""

    def tokenize(text: str) -> list[int]:
        return [i for i, word in enumerate(text.split()) for _ in range(1 + (len(word) > 6))]

    texts = bench_script.make_texts(200, 20, 60, 7, tokenize)
    lengths = [len(tokenize(t)) for t in texts]
    assert min(lengths) >= 19 and max(lengths) <= 60  # a cut may drop one two-token word below the draw
    assert len(set(lengths)) > 20 and texts == bench_script.make_texts(200, 20, 60, 7, tokenize)


def test_the_embedding_benchmark_gets_every_vector_in_order(embed_url, bench_script):
    """Its client, 16 texts 4 in flight against kvserve: each text's vector is the one a lone request gets."""
    texts = [f"text number {i} " + "word " * i for i in range(16)]
    run = asyncio.run(bench_script.embed_all(embed_url, MODEL, texts, 4))
    assert not run["failures"] and len(run["latencies"]) == 16
    alone = client(embed_url).embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for got, want in zip(run["vectors"], alone.data, strict=True):
        assert got == pytest.approx(want.embedding, abs=1e-6)
    assert sum(run["prompt_tokens"]) == alone.usage.prompt_tokens
