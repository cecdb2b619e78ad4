"""The committed openapi.yaml is exactly what the app generates, and it documents what clients need."""

from pathlib import Path

import pytest
import yaml

from server.api.app import create_app
from server.api.config import ServerConfig
from server.api.openapi import openapi_yaml

pytestmark = pytest.mark.timeout(30)

COMMITTED = Path(__file__).resolve().parents[2] / "openapi.yaml"


def test_committed_openapi_yaml_is_in_sync():
    generated = openapi_yaml(create_app(None, ServerConfig()))
    assert COMMITTED.read_bytes() == generated.encode(), (
        "openapi.yaml is stale: regenerate it with `kvserve openapi`"
    )


def test_every_route_has_component_schemas_errors_and_streams():
    schema = yaml.safe_load(COMMITTED.read_text())
    components = schema["components"]["schemas"]

    def refs(node) -> set[str]:
        if isinstance(node, dict):
            found = {node["$ref"].rsplit("/", 1)[1]} if "$ref" in node else set()
            return found.union(*(refs(v) for v in node.values()))
        if isinstance(node, list):
            return set().union(*(refs(v) for v in node))
        return set()

    assert refs(schema) <= set(components), "a $ref points at no component"
    paths = schema["paths"]
    assert set(paths) == {
        "/health", "/metrics", "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
        "/tokenize", "/detokenize", "/is_sleeping", "/server_info", "/v1/responses", "/v1/messages",
        "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
    }  # fmt: skip
    for path, methods in paths.items():
        for method, op in methods.items():
            responses = op["responses"]
            assert "422" not in responses  # validation errors are 400s
            if path != "/metrics":
                assert refs(responses["200"]["content"]["application/json"]), (path, "200")
            if method == "post":
                assert refs(op["requestBody"]["content"]["application/json"]), path
                # Anthropic's route answers errors in Anthropic's shape
                error = "AnthropicError" if path.startswith("/v1/messages") else "ErrorResponse"
                for status in ("400", "401", "404", "413", "503"):
                    assert refs(responses[status]) == {error}, (path, status)
    streams = {
        "/v1/completions": "CompletionStreamResponse",
        "/v1/chat/completions": "ChatCompletionStreamResponse",
        "/v1/responses": "ResponseStreamEvent",
        "/v1/messages": "MessageStreamEvent",
    }
    for path, events in streams.items():
        responses = paths[path]["post"]["responses"]
        assert "429" in responses
        assert refs(responses["200"]["content"]["text/event-stream"]) == {events}
    assert refs(paths["/v1/models"]["get"]["responses"]["401"]) == {"ErrorResponse"}
    assert refs(paths["/v1/models/{model}"]["get"]["responses"]["404"]) == {"ErrorResponse"}
    assert refs(paths["/health"]["get"]["responses"]["503"]) == {"ErrorResponse"}
