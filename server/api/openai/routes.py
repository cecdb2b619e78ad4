"""OpenAI's routes: /v1/completions, /v1/chat/completions, /v1/responses (and its stored responses, GET and
DELETE /v1/responses/{id}) and /v1/embeddings."""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from server.api.errors import ApiError
from server.api.openai import protocol as p
from server.api.openai import responses_protocol as rp
from server.api.openai.chat import chat
from server.api.openai.completions import completion
from server.api.openai.embeddings import embed
from server.api.openai.response_store import ResponseStore
from server.api.openai.responses import ignored_tools_header, respond
from server.api.protocol import error_body
from server.api.routes import (
    GENERATION_ERRORS,
    Ready,
    check_api_key,
    documented_errors,
    documented_stream,
    reply,
)

router = APIRouter(dependencies=[Depends(check_api_key)])
# OpenAI's error shape on every path no other API registers: its routes, the server's own, unknown paths.
ERROR_SHAPES = {"": error_body}


def response_store(request: Request) -> ResponseStore:
    return request.app.state.responses


Store = Annotated[ResponseStore, Depends(response_store)]


@router.post(
    "/v1/completions",
    response_model=p.CompletionResponse,
    responses={**documented_stream(p.CompletionStreamResponse), **GENERATION_ERRORS},
)
async def completions(body: p.CompletionRequest, serving: Ready) -> Response:
    return reply(await completion(serving, body))


@router.post(
    "/v1/chat/completions",
    response_model=p.ChatCompletionResponse,
    responses={**documented_stream(p.ChatCompletionStreamResponse), **GENERATION_ERRORS},
)
async def chat_completions(body: p.ChatCompletionRequest, serving: Ready) -> Response:
    return reply(await chat(serving, body))


@router.post(
    "/v1/responses",
    response_model=rp.ResponseObject,
    responses={**documented_stream(rp.ResponseStreamEvent, named=True), **GENERATION_ERRORS},
)
async def responses(body: rp.ResponsesRequest, serving: Ready, store: Store) -> Response:
    """OpenAI's Responses API: the conversation in the request, or continued from a stored response."""
    return reply(await respond(serving, body, store), ignored_tools_header(body))


@router.get(
    "/v1/responses/{response_id}", response_model=rp.ResponseObject, responses=documented_errors(401, 404)
)
async def stored_response(response_id: str, store: Store) -> rp.ResponseObject:
    """A response the server keeps (store, the default), as it was answered."""
    response = store.get(response_id)
    if response is None:
        raise not_stored(response_id)
    return response


@router.get(
    "/v1/responses/{response_id}/input_items",
    response_model=rp.InputItemList,
    responses=documented_errors(400, 401, 404),
)
async def stored_input_items(
    response_id: str,
    store: Store,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> rp.InputItemList:
    """The input items a stored response was asked with, newest first unless order=asc, `limit` at a time from
    the one after `after` (an item id)."""
    items = store.input_items(response_id)
    if items is None:
        raise not_stored(response_id)
    listed = [listed_item(response_id, place, item) for place, item in enumerate(items)]
    if order == "desc":
        listed.reverse()
    if after is not None:
        ids = [item["id"] for item in listed]
        if after not in ids:
            why = f"after: no input item {after[:100]!r} in response {response_id[:100]!r}"
            raise ApiError(400, why, param="after")
        listed = listed[ids.index(after) + 1 :]
    page = listed[:limit]
    return rp.InputItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(listed) > limit,
    )


@router.delete(
    "/v1/responses/{response_id}", response_model=rp.ResponseDeleted, responses=documented_errors(401, 404)
)
async def delete_response(response_id: str, store: Store) -> rp.ResponseDeleted:
    if not store.delete(response_id):
        raise not_stored(response_id)
    return rp.ResponseDeleted(id=response_id)


def listed_item(response_id: str, place: int, item: rp.InputItem) -> dict:
    """An input item as OpenAI lists it: with an id (from the response's and the item's place) and a status."""
    listed = {"id": f"{rp.ITEM_ID_PREFIXES[item.type]}_{response_id.removeprefix('resp_')}_{place}"}
    listed |= item.model_dump()
    if item.type != "reasoning":
        listed["status"] = "completed"
    return listed


def not_stored(response_id: str) -> ApiError:
    why = f"no stored response {response_id[:100]!r} (kept in memory, within --responses-store-memory)"
    return ApiError(404, why, "not_found_error", param="response_id", code="response_not_found")


@router.post(
    "/v1/embeddings",
    response_model=p.EmbeddingResponse,
    responses=documented_errors(400, 401, 404, 413, 429, 503),
)
async def embeddings(body: p.EmbeddingRequest, serving: Ready) -> Response:
    """One vector per input, pooled as the model says (a model served with --task embed or --pooling)."""
    return reply(await embed(serving, body))
