"""/v1/rerank (and /rerank) in Jina's and Cohere's shape, as vLLM and llama.cpp answer it, and vLLM's /v1/score:
(query, document) pairs scored by a reranker.

The reranker is Qwen3-Reranker's kind: a causal LM asked, under its own prompt, whether the document meets the
query, whose score is the probability of "yes" against "no" at the last position (the softmax of those two
logits), exactly as its model card computes it: the prompt's three parts (system and user opening; instruction,
query and document; the assistant's opening with an empty think block) are tokenized apart and joined.
"""

import math
import time
import uuid

from server.api import protocol as p
from server.api.errors import ApiError
from server.api.serving import Serving
from server.engine.request import PoolingParams

SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that "
    'the answer can only be "yes" or "no".'
)
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_ids(serving: Serving, query: str, document: str, instruction: str) -> list[int]:
    encode = serving.engine.tokenizer.encode
    body = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return encode(PREFIX) + encode(body) + encode(SUFFIX)


def answer_token_ids(serving: Serving) -> tuple[int, int]:
    """The ids of "no" and "yes", one token each in the reranker's vocabulary."""
    ids = [serving.engine.tokenizer.encode(word) for word in ("no", "yes")]
    if any(len(i) != 1 for i in ids):
        raise ApiError(400, 'this reranker\'s tokenizer has no single-token "yes" and "no"', param="model")
    return ids[0][0], ids[1][0]


async def score_pairs(
    serving: Serving, pairs: list[tuple[str, str]], instruction: str | None, param: str
) -> tuple[list[float], int] | None:
    """Each pair's relevance in [0, 1], and the tokens scored; None when the client went away."""
    serving.check_task("score", "reranking")
    if not pairs:
        raise ApiError(400, f"{param} must not be empty", param=param)
    if len(pairs) > p.MAX_POOLED_INPUTS:
        why = f"at most {p.MAX_POOLED_INPUTS} documents per request, got {len(pairs)}"
        raise ApiError(400, why, param=param)
    no, yes = answer_token_ids(serving)
    instruction = instruction or DEFAULT_INSTRUCTION
    prompts = [pair_ids(serving, q, d, instruction) for q, d in pairs]
    params = PoolingParams(logit_token_ids=(no, yes))
    outputs = await serving.pooled(prompts, params, param, shared_prefix=True)
    if outputs is None:
        return None
    # softmax over [no, yes], the yes probability: 1 / (1 + e^(no - yes))
    scores = [1.0 / (1.0 + math.exp(min(out.pooled[0] - out.pooled[1], 700.0))) for out in outputs]
    return scores, sum(len(ids) for ids in prompts)


async def rerank(serving: Serving, body: p.RerankRequest) -> p.RerankResponse | None:
    serving.check_model(body.model)
    documents = body.texts()
    scored = await score_pairs(serving, [(body.query, d) for d in documents], body.instruction, "documents")
    if scored is None:
        return None
    scores, num_tokens = scored
    order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties keep the documents' order
    if body.top_n:
        order = order[: body.top_n]
    results = [
        p.RerankResult(
            index=i,
            document=p.RerankDocument(text=documents[i]) if body.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    return p.RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}",
        model=serving.model_name,
        usage=p.RerankUsage(total_tokens=num_tokens),
        results=results,
    )


async def score(serving: Serving, body: p.ScoreRequest) -> p.ScoreResponse | None:
    serving.check_model(body.model)
    scored = await score_pairs(serving, body.pairs(), body.instruction, "text_2")
    if scored is None:
        return None
    scores, num_tokens = scored
    return p.ScoreResponse(
        id=f"score-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=serving.model_name,
        data=[p.ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=p.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
