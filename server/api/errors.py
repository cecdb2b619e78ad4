"""Errors as the API at hand shapes them: ApiError carries a status and OpenAI's error fields, and the handlers
turn every failure (ours, FastAPI's validation, Starlette's routing, anything unexpected) into one. Anthropic's
route (/v1/messages) answers in Anthropic's shape; every other route in OpenAI's."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from server.api.anthropic import protocol as mp
from server.api.openai import protocol as p

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300
ANTHROPIC_ROUTE = "/v1/messages"
# Anthropic's error type for each status; any other is an api_error
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error body; the app turns it into a response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> p.ErrorResponse:
        message = self.message[:MAX_ERROR_CHARS]  # bounded, whatever the input it quotes
        info = p.ErrorInfo(message=message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info)


def anthropic_error(error: ApiError) -> mp.AnthropicError:
    message = error.message[:MAX_ERROR_CHARS]
    return mp.AnthropicError(
        error=mp.ErrorDetail(type=ANTHROPIC_TYPES.get(error.status, "api_error"), message=message)
    )


def error_response(error: ApiError, path: str) -> JSONResponse:
    """The error as the API of the route at `path` shapes it."""
    anthropic = path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")
    body = anthropic_error(error) if anthropic else error.body()
    return JSONResponse(body.model_dump(), status_code=error.status, headers=error.headers)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error, request.url.path)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(_bad_request(error), request.url.path)


def _bad_request(error: RequestValidationError) -> ApiError:
    # FastAPI says 422 with a list of errors; clients expect 400 with the first one, naming the field.
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}")
    if not loc and first["type"] in ("model_attributes_type", "missing"):
        return ApiError(400, "the body must be a JSON object")
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    # Starlette's own: unknown route (404), wrong method (405), a body FastAPI could not parse (400).
    code = "not_found" if error.status_code == 404 else None
    refused = ApiError(error.status_code, str(error.detail), param=None, code=code, headers=error.headers)
    return error_response(refused, request.url.path)


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    # The server logs the traceback (Starlette re-raises after this); the client learns nothing of the code.
    log.error("request %s failed: %s", getattr(request.state, "request_id", "-"), type(error).__name__)
    return error_response(ApiError(500, "internal server error", type="internal_error"), request.url.path)
