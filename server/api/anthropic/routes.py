"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens."""

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from server.api.anthropic import protocol as mp
from server.api.anthropic.messages import message, render, request_tools
from server.api.routes import Ready, check_api_key, documented_errors, documented_stream, reply

router = APIRouter(dependencies=[Depends(check_api_key)])
# Anthropic's error shape on its routes and every path below them: its clients read no other (a 404 or 405 there
# too, and a 413 before any route is found).
ERROR_SHAPES = {"/v1/messages": mp.error_body}


@router.post(
    "/v1/messages",
    response_model=mp.MessageResponse,
    responses={
        **documented_stream(mp.MessageStreamEvent, named=True),
        **documented_errors(400, 401, 404, 413, 429, 503, error=mp.AnthropicError),
    },
)
async def messages(body: mp.MessagesRequest, serving: Ready) -> Response:
    """Anthropic's Messages API; errors come in Anthropic's shape, and the key may come as x-api-key."""
    return reply(await message(serving, body))


@router.post(
    "/v1/messages/count_tokens",
    response_model=mp.TokenCount,
    responses=documented_errors(400, 401, 404, 413, 503, error=mp.AnthropicError),
)
def count_tokens(body: mp.CountTokensRequest, serving: Ready) -> mp.TokenCount:
    """The prompt tokens a /v1/messages request with this body would have."""
    serving.check_model(body.model)
    tools = request_tools(body)
    return mp.TokenCount(input_tokens=len(render(serving, body, tools).ids))
