"""Errors: ApiError carries a status and the fields every API's error body is made of, and the handlers turn
every failure (ours, FastAPI's validation, Starlette's routing, anything unexpected) into one. Its body takes the
shape of the API whose paths it is on: each API registers its shape for its path prefixes (ERROR_SHAPES in its
routes.py), and the app hands the lot to the handlers and the request guard."""

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300


class ApiError(Exception):
    """An error with its HTTP status and the fields of its body (OpenAI's: each API's shape is made of them);
    the app turns it into a response."""

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


ErrorBody = Callable[[ApiError], BaseModel]  # an API's error shape: an error as a body of its own
ErrorShapes = dict[str, ErrorBody]  # by path prefix; "" is every path


def error_body(error: ApiError, shapes: ErrorShapes, path: str) -> BaseModel:
    """The error in the shape registered for the longest prefix of `path`: a prefix holds the path itself and
    those below it ("/v1/messages" holds "/v1/messages/count_tokens", not "/v1/messagesx")."""
    holding = [prefix for prefix in shapes if path == prefix or path.startswith(prefix + "/")]
    return shapes[max(holding, key=len)](error)


def error_response(error: ApiError, shapes: ErrorShapes, path: str) -> JSONResponse:
    """The error as the API of the route at `path` shapes it."""
    body = error_body(error, shapes, path)
    return JSONResponse(body.model_dump(), status_code=error.status, headers=error.headers)


def add_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    app.state.error_shapes = shapes
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return _response(error, request)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return _response(_bad_request(error, request.headers.get("content-type", "")), request)


def _bad_request(error: RequestValidationError, content_type: str) -> ApiError:
    # FastAPI says 422 with a list of errors; clients expect 400 with the first one, naming the field.
    first = error.errors()[0]
    where = first["loc"][1:] if first["loc"][:1] in (("body",), ("query",), ("path",)) else first["loc"]
    loc = [_printable(part) for part in where if not _validator_tag(part)]
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}")
    if not loc and first["type"] in ("model_attributes_type", "missing"):
        kind = content_type.split(";")[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):  # FastAPI read no JSON at all
            # (`curl -d` without -H sends application/x-www-form-urlencoded)
            why = f"the body must be a JSON object, sent with Content-Type: application/json, not {kind[:80]}"
            return ApiError(400, why, param="content-type")
        return ApiError(400, "the body must be a JSON object")
    param = ".".join(loc) or None
    message = _wrong_type(first) or first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
}
_JSON_TYPES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def _wrong_type(error: dict) -> str | None:
    # OpenAI's words for a value of the wrong JSON type ("expected an integer, but got a string instead")
    expected = _EXPECTED.get(error["type"])
    got = _JSON_TYPES.get(type(error.get("input")))
    if expected is None or got is None:
        return None
    return f"expected {expected}, but got {got} instead"


# the words pydantic puts in an error's location for what it tried, not where: a union's member ("str",
# "list[str]", "literal['auto']"), a validator ("function-after[_valid_unicode(), str]"), a key ("[key]")
_TYPE_WORDS = set("str int float bool list dict none bytes json-or-python lax-or-strict".split())


def _validator_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or "(" in part or part in _TYPE_WORDS)


def _printable(part) -> str:
    # a key the client sent may hold a lone surrogate, which no response can encode
    return str(part).encode("utf-8", "backslashreplace").decode()


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    # Starlette's own: unknown route (404), wrong method (405), a body FastAPI could not parse (400).
    code = "not_found" if error.status_code == 404 else None
    refused = ApiError(error.status_code, str(error.detail), param=None, code=code, headers=error.headers)
    return _response(refused, request)


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    # The server logs the traceback (Starlette re-raises after this); the client learns nothing of the code.
    log.error("request %s failed: %s", getattr(request.state, "request_id", "-"), type(error).__name__)
    return _response(ApiError(500, "internal server error", type="internal_error"), request)


def _response(error: ApiError, request: Request) -> JSONResponse:
    return error_response(error, request.app.state.error_shapes, request.url.path)
