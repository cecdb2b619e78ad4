"""What `kvserve serve` limits before any request reaches the app (server/api/uvicorn_server.py's guarded_http):
how long a request's line and headers may take, and how many connections are held."""

import socket
import time

import pytest

from server.api.app import create_app
from server.api.config import ServerConfig
from server.api.uvicorn_server import guarded_http, raise_open_files_limit
from tests.api.conftest import serve

pytestmark = pytest.mark.timeout(60)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_all(s: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def test_headers_that_do_not_arrive_in_time_end_the_connection():
    app = create_app(None, ServerConfig())
    with serve(app, http=guarded_http(0.5, 100)) as url:
        partial = connect(url)
        partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHo")
        silent = connect(url)
        start = time.monotonic()
        assert read_all(partial).startswith(b"HTTP/1.1 408 ")
        assert read_all(silent) == b""  # nothing was asked: closed without a word
        assert 0.4 < time.monotonic() - start < 5
        # headers in time, then a slow body: the headers' limit is over, the body's own (30 s) applies
        slow = connect(url)
        slow.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{"
        )
        time.sleep(1.0)
        slow.sendall(b"}")
        reply = slow.recv(4096)
        assert reply.startswith(b"HTTP/1.1 ") and not reply.startswith(b"HTTP/1.1 408"), reply[:100]


def test_connections_past_the_limit_are_closed_at_once():
    app = create_app(None, ServerConfig())
    with serve(app, http=guarded_http(30, 3)) as url:
        held = [connect(url) for _ in range(3)]
        extra = connect(url)
        start = time.monotonic()
        assert read_all(extra) == b"" and time.monotonic() - start < 5
        held[0].close()
        time.sleep(0.2)
        again = connect(url)
        again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(again).startswith(b"HTTP/1.1 503 ")  # served (no engine yet: /health says 503)


def test_the_open_files_limit_leaves_room_for_the_server_itself():
    import resource

    from server.api.uvicorn_server import OTHER_FILES

    allowed = raise_open_files_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert allowed == max(16, soft - OTHER_FILES)
    assert soft >= min(hard, 65536) or hard == resource.RLIM_INFINITY
