"""/v1/embeddings: texts or token ids in, one vector each out, in OpenAI's shape (floats or base64).

The engine pools the model's final hidden states as the served task says (server/engine/pooling.py: last token,
mean or CLS, from the model's sentence-transformers files or --pooling); here each vector is cut to `dimensions`
(Matryoshka: the first N values) and then normalised, where the model normalises, as sentence-transformers'
truncate_dim does.
"""

import base64
import math
import sys
from array import array

from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.protocol import MAX_POOLED_INPUTS, EmbeddingUsage
from server.api.serving import Serving
from server.engine.request import PoolingParams


async def embed(serving: Serving, body: p.EmbeddingRequest) -> p.EmbeddingResponse | None:
    serving.check_model(body.model)
    serving.check_task("embed", "/v1/embeddings")
    task = serving.engine.task
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise ApiError(400, "input must not be empty", param="input")
    if len(inputs) > MAX_POOLED_INPUTS:
        why = f"at most {MAX_POOLED_INPUTS} inputs per request, got {len(inputs)}"
        raise ApiError(400, why, param="input")
    if body.dimensions is not None and body.dimensions > serving.engine.hidden_size:
        why = f"dimensions must be at most the model's {serving.engine.hidden_size}, got {body.dimensions}"
        raise ApiError(400, why, param="dimensions")
    prompt = ""
    if body.prompt_name is not None:
        if body.prompt_name not in task.prompts:
            names = ", ".join(task.prompts) or "none"
            why = f"the model has no prompt named {body.prompt_name[:100]!r} (it has: {names})"
            raise ApiError(400, why, param="prompt_name")
        prompt = task.prompts[body.prompt_name]
    vocab_size = serving.engine.vocab_size
    if any(not 0 <= t < vocab_size for x in inputs if not isinstance(x, str) for t in x):
        why = (
            f"input token ids must be in [0, {vocab_size}): ids of this model's tokenizer (LangChain's "
            "OpenAIEmbeddings sends OpenAI's tiktoken ids; give it check_embedding_ctx_length=False to send text)"
        )
        raise ApiError(400, why, param="input")
    tokenizer = serving.engine.tokenizer
    prompts = [
        tokenizer.encode(prompt + x, add_special_tokens=True) if isinstance(x, str) else x for x in inputs
    ]
    outputs = await serving.pooled(prompts, PoolingParams(task.pooling), "input")
    if outputs is None:
        return None
    data = []
    for i, out in enumerate(outputs):
        vector = embedding_vector(out.pooled, body.dimensions, task.normalize)
        data.append(
            p.Embedding(index=i, embedding=as_base64(vector) if body.encoding_format == "base64" else vector)
        )
    num_tokens = sum(len(ids) for ids in prompts)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return p.EmbeddingResponse(data=data, model=serving.model_name, usage=usage)


def embedding_vector(pooled: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (all when None), scaled to unit length when the model normalises (a zero
    vector stays zero, as torch's F.normalize leaves it)."""
    values = pooled[:dimensions]
    if not normalize:
        return values
    norm = max(math.sqrt(math.fsum(v * v for v in values)), 1e-12)
    return [v / norm for v in values]


def as_base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's float32 values, little-endian, base64-encoded."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode()
