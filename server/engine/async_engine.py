"""AsyncEngine: the one place with asyncio. A background thread steps the Engine while there is work.

The event loop never waits on the model: new requests and aborts are handed to the stepping thread
through a queue and applied between steps; outputs come back with call_soon_threadsafe into one asyncio
queue per request. When idle, the thread blocks on an Event (no polling).
"""

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from server.engine.engine import Engine
from server.engine.request import FinishReason, RequestOutput, SamplingParams
from server.engine.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine]):
        """Serve `engine`, or the engine a function builds: then it is built in the stepping thread, so that
        one thread does all of its tensor work. GNU OpenMP counts the workers of every thread that has run a
        parallel region; once they outnumber the cores it stops spinning between regions, and a decode step
        ran 1.65x slower on another thread than the one that had loaded the model (measured, 2 cores).
        Raises what building raised."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", id, ids, params) | ("abort", id)
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._stats_lock = threading.Lock()
        self._num_queued = 0  # "add" messages not yet applied
        built: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(engine, built), name="kvserve-engine", daemon=True
        )
        self._thread.start()
        error = built.get()
        if error is not None:
            raise error
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len

    # --- called from the event loop -------------------------------------------------------------

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Queue the request now and return the stream of its delta outputs.

        Raises ValueError (a message for the client) when the request can never be served. Queueing at call
        time keeps the waiting count exact under a burst. Closing the stream early (client gone, task
        cancelled) aborts the request in the engine; so does dropping a stream that was never iterated.
        """
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.validate(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._send(("add", request_id, list(prompt_token_ids), params))
        outputs = self._outputs(request_id, stream)
        weakref.finalize(outputs, self._forget, request_id)
        return outputs

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output: RequestOutput = await stream.queue.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None) if finished else self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step, plus requests not yet handed to the scheduler."""
        with self._stats_lock:
            s, queued = self._stats, self._num_queued
        return EngineStats(**{**s.__dict__, "num_waiting": s.num_waiting + queued})

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for running requests to finish, then abort what is left."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        while self._streams and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.01)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _send(self, message: tuple) -> None:
        with self._stats_lock:
            self._num_queued += message[0] == "add"
            self._inbox.put(message)
        self._wake.set()

    # --- the stepping thread --------------------------------------------------------------------

    def _run(self, engine: Engine | Callable[[], Engine], built: queue.SimpleQueue) -> None:
        try:
            self.engine = engine if isinstance(engine, Engine) else engine()
            self._stats = self.engine.stats()
        except Exception as e:
            built.put(e)
            return
        built.put(None)
        while not self._stopped:
            self._apply_inbox()
            if not self.engine.has_work():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a bug or an out-of-memory: fail the requests of this batch, keep serving
                log.exception("engine step failed; aborting the running requests")
                outputs = self._abort_all("internal error while generating")
            for output in outputs:
                self._deliver(output)
            self._stats = self.engine.stats()

    def _apply_inbox(self) -> None:
        while True:
            with self._stats_lock:  # a request leaves the inbox and enters the snapshot at once
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                self._num_queued -= message[0] == "add"
                self._apply(message)
                self._stats = self.engine.stats()

    def _apply(self, message: tuple) -> None:
        if message[0] == "add":
            _, request_id, ids, params = message
            try:
                self.engine.add_request(request_id, ids, params)
            except ValueError as e:  # validated before queueing; only a race (duplicate id) lands here
                self._deliver(RequestOutput(request_id, [], "", True, FinishReason.ABORT, error=str(e)))
        else:
            output = self.engine.abort(message[1])
            if output is not None:
                self._deliver(output)

    def _abort_all(self, error: str) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self.engine.scheduler.requests):
            output = self.engine.abort(request_id)
            if output is not None:
                output.error = error
                outputs.append(output)
        return outputs

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)


async def merge(
    streams: list[AsyncIterator], until: Awaitable | None = None
) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come (say the n choices of one HTTP request), each with its
    stream's index. Ends early when `until` completes (the client went away); an exception in a stream is
    raised here. On exit the streams are cancelled, which aborts their unfinished requests in the engine.
    """
    inbox: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                inbox.put_nowait((i, item))
        except Exception as e:
            inbox.put_nowait((i, e))
        inbox.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    if until is not None:
        watcher = asyncio.ensure_future(until)
        watcher.add_done_callback(lambda f: f.cancelled() or inbox.put_nowait((-1, end)))
        tasks.append(watcher)
    num_open = len(streams)
    try:
        while num_open:
            i, item = await inbox.get()
            if i < 0:
                return
            if item is end:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        # No await here: under a cancelled (anyio) scope it would be cancelled again at once. The tasks
        # run their own cleanup (generate()'s abort) on the next loop turn.
        for task in tasks:
            task.cancel()
