"""The routes: thin functions that parse a body, call a serving function and return JSON or SSE."""

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from server.api import messages_protocol as mp
from server.api import protocol as p
from server.api import responses_protocol as rp
from server.api.chat import chat
from server.api.completions import completion
from server.api.config import ServerConfig
from server.api.errors import ApiError
from server.api.messages import chat_messages, message, request_tools
from server.api.prompt import chat_prompt_ids
from server.api.responses import ignored_tools_header, respond
from server.api.serving import ServingState, check_model

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


async def serving_state(request: Request) -> ServingState:
    state = request.app.state
    if state.engine is None:
        raise ApiError(
            503, "the model is still loading", type="unavailable_error", headers={"Retry-After": "5"}
        )
    if state.draining:
        raise ApiError(503, "the server is shutting down", type="unavailable_error")
    config: ServerConfig = state.config
    return ServingState(
        state.engine, config.served_model_name, config.system_prompt, config.max_queue, state.metrics
    )


Ready = Annotated[ServingState, Depends(serving_state)]


async def _client_gone(request: Request) -> None:
    # The body has been read, so the next message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- routes -------------------------------------------------------------------------------------


def _errors(*statuses: int, error: type = p.ErrorResponse) -> dict:
    why = {
        400: "Invalid request",
        401: "Missing or invalid API key",
        404: "Unknown model",
        413: "Request body too large",
        429: "Too many requests waiting; see Retry-After",
        503: "Model loading or server shutting down",
    }
    return {s: {"model": error, "description": why[s]} for s in statuses}


def _streamed(chunk: type, named: bool = False) -> dict:
    schema = {"$ref": f"#/components/schemas/{chunk.__name__}"}
    if named:
        about = "JSON, or with stream: true server-sent events `event: <its type>` + `data: <event JSON>`."
    else:
        about = (
            "JSON, or with stream: true server-sent events `data: <chunk JSON>` ending with `data: [DONE]`."
        )
    return {200: {"description": about, "content": {"text/event-stream": {"schema": schema}}}}


GENERATION_ERRORS = _errors(400, 401, 404, 413, 429, 503)
METRICS_CONTENT = {
    "description": "Prometheus text format",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}
health_router = APIRouter()
api_router = APIRouter(dependencies=[Depends(check_api_key)])


@health_router.get("/health", response_model=p.HealthResponse, responses=_errors(503))
async def health(request: Request) -> p.HealthResponse:
    await serving_state(request)  # raises the 503 while loading or draining
    return p.HealthResponse()


@health_router.get("/metrics", response_class=Response, responses={200: METRICS_CONTENT})
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@api_router.post(
    "/v1/completions",
    response_model=p.CompletionResponse,
    responses={**_streamed(p.CompletionStreamResponse), **GENERATION_ERRORS},
)
async def completions(body: p.CompletionRequest, request: Request, state: Ready) -> Response:
    result = await completion(state, body, request.state.request_id, lambda: _client_gone(request))
    return _respond(result)


@api_router.post(
    "/v1/chat/completions",
    response_model=p.ChatCompletionResponse,
    responses={**_streamed(p.ChatCompletionStreamResponse), **GENERATION_ERRORS},
)
async def chat_completions(body: p.ChatCompletionRequest, request: Request, state: Ready) -> Response:
    result = await chat(state, body, request.state.request_id, lambda: _client_gone(request))
    return _respond(result)


@api_router.post(
    "/v1/responses",
    response_model=rp.ResponseObject,
    responses={**_streamed(rp.ResponseStreamEvent, named=True), **GENERATION_ERRORS},
)
async def responses(body: rp.ResponsesRequest, request: Request, state: Ready) -> Response:
    """OpenAI's Responses API, stateless: nothing is stored, each request carries its whole conversation."""
    result = await respond(state, body, request.state.request_id, lambda: _client_gone(request))
    return _respond(result, ignored_tools_header(body))


@api_router.post(
    "/v1/messages",
    response_model=mp.MessageResponse,
    responses={
        **_streamed(mp.MessageStreamEvent, named=True),
        **_errors(400, 401, 404, 413, 429, 503, error=mp.AnthropicError),
    },
)
async def messages(body: mp.MessagesRequest, request: Request, state: Ready) -> Response:
    """Anthropic's Messages API; errors come in Anthropic's shape, and the key may come as x-api-key."""
    result = await message(state, body, request.state.request_id, lambda: _client_gone(request))
    return _respond(result)


@api_router.post(
    "/v1/messages/count_tokens",
    response_model=mp.TokenCount,
    responses=_errors(400, 401, 404, 413, 503, error=mp.AnthropicError),
)
def count_tokens(body: mp.CountTokensRequest, state: Ready) -> mp.TokenCount:
    """The prompt tokens a /v1/messages request with this body would have."""
    check_model(state, body.model)
    ids = chat_prompt_ids(state, chat_messages(body), tools=request_tools(body))
    return mp.TokenCount(input_tokens=len(ids))


def _model_card(state: ServingState) -> p.ModelCard:
    return p.ModelCard(id=state.model_name, created=0, max_model_len=state.engine.max_model_len)


@api_router.get("/v1/models", response_model=p.ModelList, responses=_errors(401, 503))
async def models(state: Ready) -> p.ModelList:
    return p.ModelList(data=[_model_card(state)])


@api_router.get("/v1/models/{model:path}", response_model=p.ModelCard, responses=_errors(401, 404, 503))
async def model(model: str, state: Ready) -> p.ModelCard:
    """One model, as OpenAI's `models.retrieve` asks for it (a served name may hold slashes)."""
    check_model(state, model)
    return _model_card(state)


@api_router.post("/tokenize", response_model=p.TokenizeResponse, responses=_errors(400, 401, 404, 413, 503))
def tokenize(body: p.TokenizeRequest, state: Ready) -> p.TokenizeResponse:
    check_model(state, body.model)
    if body.prompt is not None:
        ids = state.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = chat_prompt_ids(state, body.messages, body.add_generation_prompt)
    return p.TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids)


@api_router.post(
    "/detokenize", response_model=p.DetokenizeResponse, responses=_errors(400, 401, 404, 413, 503)
)
def detokenize(body: p.DetokenizeRequest, state: Ready) -> p.DetokenizeResponse:
    check_model(state, body.model)
    vocab_size = state.engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise ApiError(400, f"tokens must be ids in [0, {vocab_size})", param="tokens")
    return p.DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens))


def _respond(result, headers: dict[str, str] | None = None) -> Response:
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json", headers=headers)
    headers = {"Cache-Control": "no-cache", **(headers or {})}
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)
