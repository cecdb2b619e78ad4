"""The OpenAPI document of the served API: FastAPI's, with a 400 in place of 422 and the stream chunks and events
added. `kvserve openapi` prints it as YAML; the committed openapi.yaml is that output (a test diffs them)."""

import yaml
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from server.api.anthropic import protocol as mp
from server.api.openai import protocol as p
from server.api.openai import responses_protocol as rp


def openapi_schema(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema["components"]["schemas"]
        # Validation errors are answered as 400 ErrorResponse, never FastAPI's 422.
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        # Stream chunks and events appear in no route signature, so FastAPI leaves them out; add them.
        streamed = (
            p.CompletionStreamResponse,
            p.ChatCompletionStreamResponse,
            rp.ResponseStreamEvent,
            mp.MessageStreamEvent,
        )
        for chunk in streamed:
            chunk_schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(chunk_schema.pop("$defs", {}))
            components[chunk.__name__] = chunk_schema
        schema["components"]["schemas"] = dict(sorted(components.items()))
        app.openapi_schema = schema
    return app.openapi_schema


def openapi_yaml(app: FastAPI) -> str:
    """The app's OpenAPI schema as YAML: what `kvserve openapi` writes and the committed openapi.yaml holds."""
    return yaml.safe_dump(app.openapi(), sort_keys=False, allow_unicode=True, width=100)
