"""OpenAI's routes: /v1/completions, /v1/chat/completions, /v1/responses and /v1/embeddings."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from server.api.openai import protocol as p
from server.api.openai import responses_protocol as rp
from server.api.openai.chat import chat
from server.api.openai.completions import completion
from server.api.openai.embeddings import embed
from server.api.openai.responses import ignored_tools_header, respond
from server.api.protocol import error_body
from server.api.routes import (
    GENERATION_ERRORS,
    Ready,
    check_api_key,
    client_gone,
    documented_errors,
    documented_stream,
    reply,
)

router = APIRouter(dependencies=[Depends(check_api_key)])
# OpenAI's error shape on every path no other API registers: its routes, the server's own, unknown paths.
ERROR_SHAPES = {"": error_body}


@router.post(
    "/v1/completions",
    response_model=p.CompletionResponse,
    responses={**documented_stream(p.CompletionStreamResponse), **GENERATION_ERRORS},
)
async def completions(body: p.CompletionRequest, request: Request, state: Ready) -> Response:
    result = await completion(state, body, request.state.request_id, lambda: client_gone(request))
    return reply(result)


@router.post(
    "/v1/chat/completions",
    response_model=p.ChatCompletionResponse,
    responses={**documented_stream(p.ChatCompletionStreamResponse), **GENERATION_ERRORS},
)
async def chat_completions(body: p.ChatCompletionRequest, request: Request, state: Ready) -> Response:
    result = await chat(state, body, request.state.request_id, lambda: client_gone(request))
    return reply(result)


@router.post(
    "/v1/responses",
    response_model=rp.ResponseObject,
    responses={**documented_stream(rp.ResponseStreamEvent, named=True), **GENERATION_ERRORS},
)
async def responses(body: rp.ResponsesRequest, request: Request, state: Ready) -> Response:
    """OpenAI's Responses API, stateless: nothing is stored, each request carries its whole conversation."""
    result = await respond(state, body, request.state.request_id, lambda: client_gone(request))
    return reply(result, ignored_tools_header(body))


@router.post(
    "/v1/embeddings",
    response_model=p.EmbeddingResponse,
    responses=documented_errors(400, 401, 404, 413, 429, 503),
)
async def embeddings(body: p.EmbeddingRequest, request: Request, state: Ready) -> Response:
    """One vector per input, pooled as the model says (a model served with --task embed or --pooling)."""
    result = await embed(state, body, request.state.request_id, lambda: client_gone(request))
    return reply(result)
