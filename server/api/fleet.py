"""Routes that the routers in front of a fleet of replicas poll, beside /health, /metrics and /v1/models.

- `GET /is_sleeping` (vLLM): vLLM's production-stack router skips an engine that says it sleeps (weights
  offloaded). kvserve never sleeps; the route exists so those routers count it as awake.
- `GET /server_info` (SGLang): SGLang's model gateway (`sglang-router`) reads the served model name from it
  when a worker registers, and lists that name at its own /v1/models; without it the gateway says
  "unknown". Only the name is given: a `model_path` would make the gateway try to download a tokenizer for
  it from the Hugging Face hub.
"""

from fastapi import APIRouter, Request
from pydantic import BaseModel

from server.api.protocol import ErrorResponse


class SleepingResponse(BaseModel):
    is_sleeping: bool = False


class ServerInfoResponse(BaseModel):
    served_model_name: str


public_router = APIRouter()  # no API key, like /health
router = APIRouter()  # included behind the API key


@public_router.get("/is_sleeping", response_model=SleepingResponse)
async def is_sleeping() -> SleepingResponse:
    return SleepingResponse()


@router.get(
    "/server_info",
    response_model=ServerInfoResponse,
    responses={401: {"model": ErrorResponse, "description": "Missing or invalid API key"}},
)
async def server_info(request: Request) -> ServerInfoResponse:
    return ServerInfoResponse(served_model_name=request.app.state.config.served_model_name)
