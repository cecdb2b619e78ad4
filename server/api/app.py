"""The FastAPI app: routes, auth, limits, error mapping, health and drain. Routes are thin; serving.py works."""

import asyncio
import hmac
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated

import yaml
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from server.api import protocol as p
from server.api import serving
from server.api.metrics import Metrics
from server.api.serving import ApiError, ServingState
from server.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"[\w.:@/+=-]{1,128}")  # an X-Request-Id echoed as given; anything else is replaced


@dataclass
class ServerConfig:
    served_model_name: str = "kvserve"  # the name in /v1/models and the only `model` value accepted
    api_key: str | None = None  # when set, all routes but /health and /metrics need "Bearer <key>"
    allowed_origins: list[str] = field(default_factory=list)  # CORS origins; empty = no CORS headers at all
    max_queue: int = 256  # waiting requests at which new ones get 429
    max_request_bytes: int = 4 << 20  # larger bodies get 413
    read_timeout: float = 30.0  # seconds a request body may take to arrive in full; slower ones get 408
    shutdown_timeout: float = 30.0  # seconds running requests get to finish when draining
    system_prompt: str | None = None  # put first in chat requests that have no system message


def create_app(engine: AsyncEngine | None, config: ServerConfig) -> FastAPI:
    """engine=None: still loading; every API route answers 503 until set_engine()."""
    app = FastAPI(
        title="kvserve",
        version="v1",
        summary="An OpenAI-compatible inference server",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # the schema ships as openapi.yaml; nothing beyond the API is served
        separate_input_output_schemas=False,
    )
    app.state.engine = engine
    app.state.config = config
    app.state.draining = False
    app.state.metrics = Metrics(config.served_model_name, lambda: app.state.engine)
    app.include_router(health_router)
    app.include_router(api_router)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(
        RequestGuard, max_request_bytes=config.max_request_bytes, read_timeout=config.read_timeout
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.openapi = lambda: _openapi(app)
    return app


def set_engine(app: FastAPI, engine: AsyncEngine) -> None:
    """The model has loaded: start serving."""
    app.state.engine = engine


def begin_drain(app: FastAPI) -> None:
    """/health turns 503 and new requests get 503; requests already running go on."""
    app.state.draining = True


async def drain(app: FastAPI) -> None:
    """begin_drain, then wait up to shutdown_timeout for running requests; the rest end with finish_reason abort."""
    begin_drain(app)
    if app.state.engine is not None:
        await app.state.engine.drain(app.state.config.shutdown_timeout)


# --- dependencies -------------------------------------------------------------------------------


async def check_api_key(request: Request) -> None:
    key = request.app.state.config.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
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


def _errors(*statuses: int) -> dict:
    why = {
        400: "Invalid request",
        401: "Missing or invalid API key",
        404: "Unknown model",
        413: "Request body too large",
        429: "Too many requests waiting; see Retry-After",
        503: "Model loading or server shutting down",
    }
    return {s: {"model": p.ErrorResponse, "description": why[s]} for s in statuses}


def _streamed(chunk: type) -> dict:
    schema = {"$ref": f"#/components/schemas/{chunk.__name__}"}
    about = "JSON, or with stream: true server-sent events `data: <chunk JSON>` ending with `data: [DONE]`."
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
    result = await serving.completion(state, body, request.state.request_id, lambda: _client_gone(request))
    return _respond(result)


@api_router.post(
    "/v1/chat/completions",
    response_model=p.ChatCompletionResponse,
    responses={**_streamed(p.ChatCompletionStreamResponse), **GENERATION_ERRORS},
)
async def chat_completions(body: p.ChatCompletionRequest, request: Request, state: Ready) -> Response:
    result = await serving.chat(state, body, request.state.request_id, lambda: _client_gone(request))
    return _respond(result)


def _model_card(state: ServingState) -> p.ModelCard:
    return p.ModelCard(id=state.model_name, created=0, max_model_len=state.engine.max_model_len)


@api_router.get("/v1/models", response_model=p.ModelList, responses=_errors(401, 503))
async def models(state: Ready) -> p.ModelList:
    return p.ModelList(data=[_model_card(state)])


@api_router.get("/v1/models/{model:path}", response_model=p.ModelCard, responses=_errors(401, 404, 503))
async def model(model: str, state: Ready) -> p.ModelCard:
    """One model, as OpenAI's `models.retrieve` asks for it (a served name may hold slashes)."""
    serving.check_model(state, model)
    return _model_card(state)


@api_router.post("/tokenize", response_model=p.TokenizeResponse, responses=_errors(400, 401, 404, 413, 503))
def tokenize(body: p.TokenizeRequest, state: Ready) -> p.TokenizeResponse:
    serving.check_model(state, body.model)
    if body.prompt is not None:
        ids = state.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = serving.chat_prompt_ids(state, body.messages, body.add_generation_prompt)
    return p.TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids)


@api_router.post(
    "/detokenize", response_model=p.DetokenizeResponse, responses=_errors(400, 401, 404, 413, 503)
)
def detokenize(body: p.DetokenizeRequest, state: Ready) -> p.DetokenizeResponse:
    serving.check_model(state, body.model)
    vocab_size = state.engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise ApiError(400, f"tokens must be ids in [0, {vocab_size})", param="tokens")
    return p.DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens))


def _respond(result) -> Response:
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# --- errors -------------------------------------------------------------------------------------


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    # FastAPI says 422 with a list of errors; OpenAI clients expect 400 with the first one, naming the field.
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "json_invalid":
        return error_response(ApiError(400, f"the body is not valid JSON: {first['msg']}"))
    if not loc and first["type"] in ("model_attributes_type", "missing"):
        return error_response(ApiError(400, "the body must be a JSON object"))
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    return error_response(ApiError(400, f"{param}: {message}" if param else message, param=param))


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    # Starlette's own: unknown route (404), wrong method (405), a body FastAPI could not parse (400).
    code = "not_found" if error.status_code == 404 else None
    return error_response(
        ApiError(error.status_code, str(error.detail), param=None, code=code, headers=error.headers)
    )


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    # The server logs the traceback (Starlette re-raises after this); the client learns nothing of the code.
    log.error("request %s failed: %s", getattr(request.state, "request_id", "-"), type(error).__name__)
    return error_response(ApiError(500, "internal server error", type="internal_error"))


class RequestGuard:
    """Pure ASGI middleware (BaseHTTPMiddleware would stand between a stream and the client's disconnect):
    gives every request an X-Request-Id, echoed in the response, and refuses bodies over the size limit,
    by Content-Length and by counting what actually arrives, before the app reads any of it. A body that
    has not arrived in full within read_timeout seconds gets 408 and the connection is closed; the engine
    never sees a request before its whole body is here, so a stalled client holds no engine resources."""

    def __init__(self, app, max_request_bytes: int, read_timeout: float = 30.0):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        if scope["method"] != "POST":
            return await self.app(scope, receive, send_with_id)
        too_large = ApiError(
            413, f"the request body is over {self.max_request_bytes} bytes", code="request_too_large"
        )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_request_bytes:
            return await error_response(too_large)(scope, receive, send_with_id)
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.read_timeout):  # for the whole body: trickling does not reset it
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
                    if size > self.max_request_bytes:
                        return await error_response(too_large)(scope, receive, send_with_id)
        except TimeoutError:
            slow = ApiError(
                408,
                f"the request body did not arrive within {self.read_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            )
            return await error_response(slow)(scope, receive, send_with_id)
        body = b"".join(chunks)
        try:
            body.decode()  # JSON is UTF-8; say so rather than FastAPI's "error parsing the body"
        except UnicodeDecodeError:
            return await error_response(ApiError(400, "the body is not valid UTF-8"))(
                scope, receive, send_with_id
            )
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send_with_id)


# --- OpenAPI ------------------------------------------------------------------------------------


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema["components"]["schemas"]
        # Validation errors are answered as 400 ErrorResponse, never FastAPI's 422.
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        # Stream chunks appear in no route signature, so FastAPI leaves them out; add them.
        for chunk in (p.CompletionStreamResponse, p.ChatCompletionStreamResponse):
            chunk_schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(chunk_schema.pop("$defs", {}))
            components[chunk.__name__] = chunk_schema
        schema["components"]["schemas"] = dict(sorted(components.items()))
        app.openapi_schema = schema
    return app.openapi_schema


def openapi_yaml(app: FastAPI) -> str:
    """The app's OpenAPI schema as YAML: what `kvserve openapi` writes and the committed openapi.yaml holds."""
    return yaml.safe_dump(app.openapi(), sort_keys=False, allow_unicode=True, width=100)
