"""The FastAPI app from a factory: state, routers, error handlers, middleware; loading and draining.

Each API's routes live in its package (openai/, anthropic/) and run the serving pipeline (serving.py); the
server's own routes and what all routes share in routes.py; errors in errors.py, the request guard in
middleware.py, the OpenAPI document in openapi.py.
"""

import logging

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.api import fleet
from server.api.anthropic import routes as anthropic
from server.api.config import ServerConfig
from server.api.errors import add_error_handlers
from server.api.metrics import Metrics
from server.api.middleware import RequestGuard
from server.api.openai import routes as openai
from server.api.openai.response_store import ResponseStore
from server.api.openapi import openapi_schema
from server.api.reasoning import choose_format
from server.api.routes import api_router, check_api_key, health_router
from server.api.ui import ui_router
from server.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)


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
    app.state.config = config
    set_engine(app, engine)
    app.state.draining = False
    app.state.metrics = Metrics(config.served_model_name, lambda: app.state.engine)
    app.state.responses = ResponseStore(config.responses_store_memory)
    app.include_router(health_router)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(api_router)
    app.include_router(fleet.public_router)
    app.include_router(fleet.router, dependencies=[Depends(check_api_key)])
    if config.ui:
        app.include_router(ui_router)
    error_shapes = {**openai.ERROR_SHAPES, **anthropic.ERROR_SHAPES}  # each API's on its paths
    add_error_handlers(app, error_shapes)
    app.add_middleware(
        RequestGuard,
        error_shapes=error_shapes,
        max_request_bytes=config.max_request_bytes,
        read_timeout=config.read_timeout,
    )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.openapi = lambda: openapi_schema(app)
    return app


def set_engine(app: FastAPI, engine: AsyncEngine) -> None:
    """The model has loaded: start serving (None: not yet)."""
    app.state.reasoning = None
    if engine is not None:
        app.state.reasoning, why = choose_format(engine.tokenizer, app.state.config.reasoning_parser)
        log.info(
            "reasoning parser: %s (%s)", app.state.reasoning.name if app.state.reasoning else "none", why
        )
    app.state.engine = engine


def begin_drain(app: FastAPI) -> None:
    """/health turns 503 and new requests get 503; requests already running go on."""
    app.state.draining = True


async def drain(app: FastAPI) -> None:
    """begin_drain, then wait up to shutdown_timeout for running requests; the rest end with finish_reason abort."""
    begin_drain(app)
    if app.state.engine is not None:
        await app.state.engine.drain(app.state.config.shutdown_timeout)
