"""Running the app under uvicorn: limits on connections before any request is read, a drain on SIGTERM that keeps
the listener open, and a periodic stats line."""

import asyncio
import logging
import resource
import threading
import time

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.api.app import begin_drain, drain
from server.engine.async_engine import AsyncEngine

log = logging.getLogger("kvserve")


# descriptors kept for what is not a connection: the model's files, the log, the engine's threads' pipes
OTHER_FILES = 256
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (64 Ki at most): each connection is one,
    and distributions start processes at 1,024. Returns the connections the server may then hold."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft == resource.RLIM_INFINITY or soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass  # a container may refuse: the limit stays as it was
    return max(16, soft - OTHER_FILES)


def guarded_http(headers_seconds: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with two limits it lacks, both before any request reaches the app (whose own
    guard, server/api/middleware.py, times the body): a request's line and headers must arrive within
    headers_seconds of the connection (or of its last response), else 408 and the connection closes; and past
    max_connections, a new connection is closed at once. Without them a client that sent part of its headers
    and then nothing held its connection forever, and 20,000 such held every descriptor the process had: the
    server accepted nothing more (measured by the hostile-input audit of 2026-12-04)."""

    last_warning = float("-inf")  # a flood is said once a minute, not once a connection

    class GuardedH11(H11Protocol):
        _headers_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            nonlocal last_warning
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                if time.monotonic() - last_warning > 60:
                    log.warning("more than %d connections: closing new ones as they come", max_connections)
                    last_warning = time.monotonic()
                transport.close()
                return
            self._time_headers()

        def connection_lost(self, exc) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._time_headers()

        def _time_headers(self) -> None:
            # h11's IDLE: the client has not yet sent a request's line and headers in full
            if self.conn.their_state is not h11.IDLE:
                self._stop_timer()
            elif self._headers_timer is None and not self.transport.is_closing():
                self._headers_timer = self.loop.call_later(headers_seconds, self._headers_too_slow)

        def _stop_timer(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_too_slow(self) -> None:
            self._headers_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                if self.conn.trailing_data[0]:  # part of a request came: say why it ends
                    self.transport.write(TIMED_OUT)
                self.transport.close()

    return GuardedH11


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: /health turns 503, new requests get 503 while the listener stays open,
    running requests get --shutdown-timeout seconds (then end with finish_reason abort), then uvicorn exits.
    A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        if self.draining or self.app.state.engine is None:
            return super().handle_exit(sig, frame)
        self.draining = True
        begin_drain(self.app)
        log.info("draining: %d requests in flight, up to %.0f s", self.app.state.engine.num_unfinished,
                 self.app.state.config.shutdown_timeout)  # fmt: skip
        asyncio.get_event_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await drain(self.app)
        self.should_exit = True


def log_stats_periodically(engine: AsyncEngine, server: uvicorn.Server, every: float = 10.0) -> None:
    """Log throughput, running / waiting and KV usage every `every` seconds while there is traffic."""
    last = engine.stats()
    last_time = time.monotonic()
    while not server.should_exit:
        threading.Event().wait(every)
        now, stats = time.monotonic(), engine.stats()
        tokens = stats.num_generation_tokens - last.num_generation_tokens
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        if tokens or prompt or stats.num_running or stats.num_waiting:
            log.info(
                "throughput: prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | KV cache %.1f%%",
                prompt / (now - last_time), tokens / (now - last_time), stats.num_running, stats.num_waiting,
                100 * stats.kv_cache_usage,
            )  # fmt: skip
        last, last_time = stats, now
