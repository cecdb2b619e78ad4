"""Live servers for the API tests: uvicorn on a free loopback port in a background thread, one app per test
module around engines shared by the whole session (apps are cheap, engines are not)."""

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from server.api.config import ServerConfig
from server.engine.async_engine import AsyncEngine
from server.engine.config import EngineConfig
from server.engine.engine import Engine

DEFAULT_NAME = "smollm2"


@contextmanager
def serve(app, **uvicorn_config) -> Iterator[str]:
    """Run `app` on 127.0.0.1:<free port>; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, **uvicorn_config)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def make_engine(path, **config) -> AsyncEngine:
    """Built on its stepping thread, as `kvserve serve` does."""
    return AsyncEngine(lambda: Engine(str(path), EngineConfig(**{"kv_cache_memory": 64 << 20, **config})))


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir) -> Iterator[AsyncEngine]:
    engine = make_engine(tiny_llama_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def long_engine(tiny_model_factory) -> Iterator[AsyncEngine]:
    """A tiny model with a long context and max_num_seqs=1: requests that stay running or waiting while a
    test acts on them (queue limits, drains, disconnects)."""
    engine = make_engine(tiny_model_factory("llama", max_position_embeddings=4096), max_num_seqs=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def default_engine(default_model_dir) -> Iterator[AsyncEngine]:
    engine = make_engine(default_model_dir)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def default_server(default_engine) -> Iterator[str]:
    """The real default model behind a server with the default settings; its base URL."""
    with serve(create_app(default_engine, ServerConfig(served_model_name=DEFAULT_NAME))) as url:
        yield url


@pytest.fixture
def start_server():
    """start_server(engine, **ServerConfig fields) -> (base URL, app); stopped at the end of the test."""
    stack = []

    def start(engine: AsyncEngine | None, **config):
        app = create_app(engine, ServerConfig(**{"served_model_name": "test-model", **config}))
        server = serve(app)
        stack.append(server)
        return server.__enter__(), app

    yield start
    for server in reversed(stack):
        server.__exit__(None, None, None)


def _scrape(url: str, idle: bool = False) -> dict[str, float]:
    """/metrics as {sample name with its non-model labels: value}, e.g. 'kvserve:request_success_total{stop}'.

    idle: wait for the engine's stats snapshot to show no requests. The snapshot is taken just after a step's
    outputs go out, so a client can get its answer a moment before the counters include it.
    """
    deadline = time.monotonic() + 5
    while True:
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
            for s in family.samples:
                labels = ",".join(v for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        busy = samples["kvserve:num_requests_running"] + samples["kvserve:num_requests_waiting"]
        if not idle or busy == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.01)


def _wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def serve_app():
    """serve_app(app): a context manager running the app (its base URL), for a test that stops it itself."""
    return serve


@pytest.fixture
def scrape():
    return _scrape


@pytest.fixture
def wait_for():
    return _wait_for


def _sse_events(raw: bytes) -> list[dict]:
    """The JSON events of a complete SSE body, checking the framing: strict UTF-8, only `data: ` lines, one
    blank line after each event, and `data: [DONE]` last."""
    text = raw.decode("utf-8")  # strict: a broken character fails here
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    payloads = []
    for block in blocks[:-2]:
        assert block.startswith("data: ") and "\n" not in block, block
        payloads.append(json.loads(block.removeprefix("data: ")))
    return payloads


@pytest.fixture
def sse_events():
    return _sse_events


def _named_sse_events(raw: bytes) -> list[dict]:
    """The JSON events of a complete SSE body of named events (Responses', Anthropic's), checking the framing:
    strict UTF-8, each event an `event: <name>` line then one `data: ` line whose JSON has that type, a blank
    line after each, and no [DONE]."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n") and "[DONE]" not in text, text[-200:]
    payloads = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == head.removeprefix("event: "), block
        payloads.append(payload)
    return payloads


@pytest.fixture
def named_sse_events():
    return _named_sse_events


@pytest.fixture
def new_engine():
    """new_engine(model dir, **EngineConfig fields) -> AsyncEngine, shut down at the end of the test."""
    engines = []

    def make(path, **config) -> AsyncEngine:
        engines.append(make_engine(path, **config))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()
