"""Running the app under uvicorn: a drain on SIGTERM that keeps the listener open, and a periodic stats line."""

import asyncio
import logging
import threading
import time

import uvicorn
from fastapi import FastAPI

from server.api.app import begin_drain, drain
from server.engine.async_engine import AsyncEngine

log = logging.getLogger("kvserve")


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
