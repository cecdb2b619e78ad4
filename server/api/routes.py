"""What every API's routes share, and the server's own routes.

A route is thin: it parses a body, calls its endpoint with the request's Serving and returns JSON or SSE. Here
are what the routes depend on (the API key as OpenAI's or Anthropic's clients send it, the request's Serving
with its 503s, the client going away), how a route documents its errors and its stream in openapi.yaml, the
reply, and the routes no one API owns: /health, /metrics, /v1/models, /tokenize and /detokenize, /v1/rerank
(and /rerank) and /v1/score, in OpenAI's, vLLM's and Jina's shapes. Each API's own routes are in its package
(openai/routes.py, anthropic/routes.py).
"""

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from server.api import protocol as p
from server.api.config import ServerConfig
from server.api.errors import ApiError
from server.api.prompt import chat_prompt_ids
from server.api.scoring import rerank, score
from server.api.serving import Serving
from server.api.structured import chat_function, offered_tools

# --- dependencies -------------------------------------------------------------------------------


async def check_api_key(request: Request) -> None:
    """The key as OpenAI's clients send it (Authorization: Bearer) or as Anthropic's do (x-api-key)."""
    key = request.app.state.config.api_key
    if key is None:
        return
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    given = [request.headers.get("x-api-key", ""), bearer.strip() if scheme.lower() == "bearer" else ""]
    if not any(g and hmac.compare_digest(g.encode(), key.encode()) for g in given):
        headers = {"WWW-Authenticate": "Bearer"}
        raise ApiError(
            401, "missing or invalid API key", "authentication_error", code="invalid_api_key", headers=headers
        )


async def client_gone(request: Request) -> None:
    # The body has been read, so the next message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def serving_for(request: Request) -> Serving:
    """The request's way through the serving pipeline; a 503 while the model loads or the server drains."""
    state = request.app.state
    if state.engine is None:
        raise ApiError(
            503, "the model is still loading", type="unavailable_error", headers={"Retry-After": "5"}
        )
    if state.draining:
        raise ApiError(503, "the server is shutting down", type="unavailable_error")
    config: ServerConfig = state.config
    return Serving(
        state.engine,
        config.served_model_name,
        config.system_prompt,
        config.max_queue,
        state.metrics,
        request.state.request_id,
        request.state.received,
        lambda: client_gone(request),
        state.reasoning,
        tuple(config.model_aliases),
        config.log_requests,
    )


Ready = Annotated[Serving, Depends(serving_for)]


# --- routes -------------------------------------------------------------------------------------


def documented_errors(*statuses: int, error: type = p.ErrorResponse) -> dict:
    why = {
        400: "Invalid request",
        401: "Missing or invalid API key",
        404: "Unknown model",
        413: "Request body too large",
        429: "Too many requests waiting; see Retry-After",
        503: "Model loading or server shutting down",
    }
    return {s: {"model": error, "description": why[s]} for s in statuses}


def documented_stream(chunk: type, named: bool = False) -> dict:
    schema = {"$ref": f"#/components/schemas/{chunk.__name__}"}
    if named:
        about = "JSON, or with stream: true server-sent events `event: <its type>` + `data: <event JSON>`."
    else:
        about = (
            "JSON, or with stream: true server-sent events `data: <chunk JSON>` ending with `data: [DONE]`."
        )
    return {200: {"description": about, "content": {"text/event-stream": {"schema": schema}}}}


GENERATION_ERRORS = documented_errors(400, 401, 404, 413, 429, 503)
METRICS_CONTENT = {
    "description": "Prometheus text format",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}
health_router = APIRouter()
api_router = APIRouter(dependencies=[Depends(check_api_key)])  # the server's own: models and tokens


@health_router.get("/health", response_model=p.HealthResponse, responses=documented_errors(503))
async def health(request: Request) -> p.HealthResponse:
    await serving_for(request)  # raises the 503 while loading or draining
    return p.HealthResponse()


@health_router.get("/metrics", response_class=Response, responses={200: METRICS_CONTENT})
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_card(serving: Serving, name: str) -> p.ModelCard:
    return p.ModelCard(id=name, created=0, max_model_len=serving.engine.max_model_len)


@api_router.get("/v1/models", response_model=p.ModelList, responses=documented_errors(401, 503))
async def models(serving: Ready) -> p.ModelList:
    return p.ModelList(
        data=[_model_card(serving, name) for name in (serving.model_name, *serving.model_aliases)]
    )


@api_router.get(
    "/v1/models/{model:path}", response_model=p.ModelCard, responses=documented_errors(401, 404, 503)
)
async def model(model: str, serving: Ready) -> p.ModelCard:
    """One model, as OpenAI's `models.retrieve` asks for it (a served name may hold slashes)."""
    serving.check_model(model)
    return _model_card(serving, model)


@api_router.post(
    "/tokenize", response_model=p.TokenizeResponse, responses=documented_errors(400, 401, 404, 413, 503)
)
def tokenize(body: p.TokenizeRequest, serving: Ready) -> p.TokenizeResponse:
    serving.check_model(body.model)
    if body.prompt is not None:
        ids = serving.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        continued = body.continue_final_message
        tools = offered_tools([chat_function(t) for t in body.tools or []], "auto", True)
        ids = chat_prompt_ids(
            serving, body.messages, body.add_generation_prompt, tools, continue_final_message=continued
        )
    return p.TokenizeResponse(count=len(ids), max_model_len=serving.engine.max_model_len, tokens=ids)


@api_router.post(
    "/detokenize", response_model=p.DetokenizeResponse, responses=documented_errors(400, 401, 404, 413, 503)
)
def detokenize(body: p.DetokenizeRequest, serving: Ready) -> p.DetokenizeResponse:
    serving.check_model(body.model)
    vocab_size = serving.engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise ApiError(400, f"tokens must be ids in [0, {vocab_size})", param="tokens")
    return p.DetokenizeResponse(prompt=serving.engine.tokenizer.decode(body.tokens))


@api_router.post(
    "/v1/rerank", response_model=p.RerankResponse, responses=documented_errors(400, 401, 404, 413, 429, 503)
)
@api_router.post("/rerank", response_model=p.RerankResponse, include_in_schema=False)
async def rerank_documents(body: p.RerankRequest, serving: Ready) -> Response:
    """The documents by relevance to the query, best first (a reranker served with --task score). /rerank is
    the same route, as llama.cpp and Jina spell it."""
    return reply(await rerank(serving, body))


@api_router.post(
    "/v1/score", response_model=p.ScoreResponse, responses=documented_errors(400, 401, 404, 413, 429, 503)
)
async def score_pairs(body: p.ScoreRequest, serving: Ready) -> Response:
    """vLLM's score route: each text_2's relevance to text_1 (or to its own text_1), in their order."""
    return reply(await score(serving, body))


def reply(result, headers: dict[str, str] | None = None) -> Response:
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json", headers=headers)
    headers = {"Cache-Control": "no-cache", **(headers or {})}
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)
