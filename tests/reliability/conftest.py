"""Fixtures of the reliability suite: real `kvserve serve` processes, stopped after each test."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.live_server import Server, start_server


@pytest.fixture
def spawn(tmp_path) -> Iterator:
    """spawn(model_dir, *flags) -> Server; every server is stopped at the end of the test."""
    servers: list[Server] = []

    def make(model_dir, *flags: str) -> Server:
        servers.append(start_server(model_dir, tmp_path / f"server{len(servers)}.log", *flags))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def long_tiny_model(tiny_model_factory) -> Path:
    """The tiny random llama with a long context, for requests that must stay in flight."""
    return tiny_model_factory("llama", max_position_embeddings=4096)
