"""Security: the API key guards every API route (not /health, /metrics or the chat page) and never reaches the
logs; no request names a file the server reads; CORS is off unless origins are given; the default bind is
loopback."""

import httpx
import pytest

from server import cli, commands
from server.api import protocol as own
from server.api.anthropic import protocol as mp
from server.api.openai import protocol as p
from server.api.openai import responses_protocol as rp
from tests.helpers.live_server import MODEL_NAME, assert_anthropic_error, assert_openai_error

KEY = "sk-kvserve-test-7c1f9e0a5b"
ROUTES = [
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL_NAME}", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/server_info", None),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_api_key_on_every_route_and_never_in_the_logs(spawn, tiny_llama_dir):
    server = spawn(tiny_llama_dir, "--api-key", KEY, "--log-level", "debug")
    client = httpx.Client(base_url=server.url, timeout=30)
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
             {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}]  # fmt: skip
    wrong += [{"x-api-key": "wrong"}, {"x-api-key": f"Bearer {KEY}"}, {"x-api-key": ""}]
    for method, route, body in ROUTES:
        for headers in wrong:
            r = client.request(method, route, json=body, headers=headers)
            if route.startswith("/v1/messages"):  # Anthropic's route answers in Anthropic's shape
                assert assert_anthropic_error(r, 401)["type"] == "authentication_error"
            else:
                assert_openai_error(r, 401)
            assert r.headers["www-authenticate"] == "Bearer"
        for headers in [
            {"Authorization": f"Bearer {KEY}"},
            {"x-api-key": KEY},
        ]:  # OpenAI's clients, Anthropic's
            r = client.request(method, route, json=body, headers=headers)
            assert r.status_code == 200, (route, r.text)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    page = client.get("/")  # the chat page asks for the key in the browser; it holds none
    assert page.status_code == 200 and "<title>kvserve chat</title>" in page.text and KEY not in page.text
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    # a request that carries the key in its body and a wrong key in the header: neither is logged
    client.post(
        "/v1/completions", json={"prompt": KEY, "max_tokens": 2}, headers={"Authorization": f"Bearer {KEY}"}
    )
    client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}-wrong"})
    log = server.log()
    assert "DEBUG" in log  # the debug level was on
    assert KEY not in log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_request_can_name_a_file(spawn, tiny_llama_dir):
    server = spawn(tiny_llama_dir)
    client = httpx.Client(base_url=server.url, timeout=30)
    for path in [str(tiny_llama_dir), str(tiny_llama_dir / "config.json"), "/etc/passwd", "../../etc/passwd",
                 "file:///etc/passwd", "~/.ssh/id_rsa"]:  # fmt: skip
        for route, body in [
            ("/v1/completions", {"model": path, "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": path, "messages": [{"role": "user", "content": "hi"}]}),
            ("/tokenize", {"model": path, "prompt": "hi"}),
            ("/detokenize", {"model": path, "tokens": [5]}),
            ("/v1/responses", {"model": path, "input": "hi"}),
        ]:
            assert assert_openai_error(client.post(route, json=body), 404)["code"] == "model_not_found"
        message = {"model": path, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (
            assert_anthropic_error(client.post("/v1/messages", json=message), 404)["type"]
            == "not_found_error"
        )
        # fields other servers read files from are ignored, never opened: the answer is the usual one
        body = {"prompt": path, "max_tokens": 2, "temperature": 0, "chat_template": path,
                "chat_template_kwargs": {"path": path}}  # fmt: skip
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and "root:" not in r.text
        # a schema given as a string is read as JSON, never as a file name
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "guided_json": path})
        assert assert_openai_error(r, 400)["param"] == "structured_outputs" and "root:" not in r.text
        # the chat template's variables are values its sandbox reads, never a template or a file to open
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                "chat_template_kwargs": {"path": path, "template": path, "include": path}}  # fmt: skip
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and "root:" not in r.text
    # no request field of the API takes a path or a template: the full list of what requests can carry
    fields = set()
    requests = (p.CompletionRequest, p.ChatCompletionRequest, own.TokenizeRequest, own.DetokenizeRequest)
    for model in (*requests, rp.ResponsesRequest, mp.MessagesRequest, mp.CountTokensRequest):
        fields |= set(model.model_fields)
    named = {f for f in fields if any(w in f for w in ("path", "file", "template", "dir", "url"))}
    assert named == {"chat_template_kwargs"}  # the template's variables, checked above


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cors_only_for_allowed_origins(spawn, tiny_llama_dir):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    default = spawn(tiny_llama_dir)
    r = httpx.get(f"{default.url}/v1/models", headers={"Origin": "https://app.example"}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{default.url}/v1/completions", headers=preflight, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    allowed = spawn(tiny_llama_dir, "--allowed-origins", "https://app.example,https://b.example")
    r = httpx.get(f"{allowed.url}/v1/models", headers={"Origin": "https://app.example"}, timeout=30)
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(f"{allowed.url}/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(f"{allowed.url}/v1/models", headers={"Origin": "https://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(
        f"{allowed.url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers


@pytest.mark.timeout(60)
def test_defaults_bind_loopback_and_time_out_reads(monkeypatch):
    for name in ("KVSERVE_HOST", "KVSERVE_READ_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    parsed = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: parsed.append(args) or 0)
    assert cli.main(["serve", "--model", "unused"]) == 0
    assert parsed[0].host == "127.0.0.1"
    assert parsed[0].read_timeout == 30.0
    assert commands.server_config(parsed[0], "unused").read_timeout == 30.0
    monkeypatch.setenv("KVSERVE_READ_TIMEOUT", "5")
    assert cli.main(["serve", "--model", "unused"]) == 0
    assert parsed[1].read_timeout == 5.0
