"""The one middleware: request ids, body size and read-time limits, before the app reads a byte."""

import asyncio
import logging
import re
import time
import uuid

from server.api.errors import ApiError, ErrorShapes, error_response

REQUEST_ID = re.compile(r"[\w.:@/+=-]{1,128}")  # an X-Request-Id echoed as given; anything else is replaced

log = logging.getLogger("kvserve")


class ClientNotReading(Exception):
    """A stream's client read none of it for read_timeout seconds."""


class ChunkWatch:
    """Raises ClientNotReading in a stream's task when one of its chunks has waited `seconds` to be taken by the
    connection. One timer a stream, re-armed only when it fires, rather than asyncio.timeout around each chunk:
    arming and cancelling a timer every token took ~8% of the event loop's time at 256 streams."""

    __slots__ = ("seconds", "loop", "task", "since", "timer", "expired")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task | None = None
        self.since: float | None = None  # when the chunk being sent began to wait; None: none is
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False

    async def send(self, send, message) -> None:
        self.task, self.since = asyncio.current_task(), self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(self.since + self.seconds, self._check)
        try:
            await send(message)
        except asyncio.CancelledError:
            if self.expired and self.task.uncancel() == 0:  # cancelled by us alone, as asyncio.timeout does
                raise ClientNotReading from None
            raise
        finally:
            self.since = None

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        if self.since is None:  # nothing waits: the next chunk arms it again
            return
        due = self.since + self.seconds
        if self.loop.time() < due:
            self.timer = self.loop.call_at(due, self._check)
        else:
            self.expired = True
            self.task.cancel()


class RequestGuard:
    """Pure ASGI middleware (BaseHTTPMiddleware would stand between a stream and the client's disconnect):
    gives every request an X-Request-Id, echoed in the response, and refuses bodies over the size limit,
    by Content-Length and by counting what actually arrives, before the app reads any of it. A body that
    has not arrived in full within read_timeout seconds gets 408 and the connection is closed; the engine
    never sees a request before its whole body is here, so a stalled client holds no engine resources.
    `request.state.received` says when it was all here (time.monotonic(); a request without a body: when it came).

    HEAD is answered as GET without the body, on every route: FastAPI gives a GET route no HEAD (a 405), and
    clients probe with one (Claude Code sends `HEAD /` as it starts).

    A stream whose client reads none of it for read_timeout seconds (a chunk not taken by the connection in that
    time: its buffers are full) is dropped, which aborts its request: the engine would otherwise generate it to
    its end, its output piling up unread (one such stream held 546 MB: the hostile-input audit). A complete
    body (a request's one answer) has no such limit: it is all made already, and a slow link may take long."""

    def __init__(self, app, error_shapes: ErrorShapes, max_request_bytes: int, read_timeout: float = 30.0):
        self.app = app
        self.error_shapes = error_shapes  # its refusals come before any route, in the shape of the path's API
        self.max_request_bytes = max_request_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self._guarded(scope, receive, send)
        except ClientNotReading:
            request_id = scope["state"]["request_id"]
            log.warning("request %s: its client read nothing of the stream for %g s: dropped", request_id,
                        self.read_timeout)  # fmt: skip

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["received"] = request_id, time.monotonic()
        watch = ChunkWatch(self.read_timeout)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            if message["type"] == "http.response.body" and message.get("more_body"):  # a stream's chunk
                return await watch.send(send, message)
            watch.close()
            await send(message)

        if scope["method"] == "HEAD":
            return await self.app({**scope, "method": "GET"}, receive, headless(send_with_id))
        if scope["method"] != "POST":
            return await self.app(scope, receive, send_with_id)
        too_large = ApiError(
            413, f"the request body is over {self.max_request_bytes} bytes", code="request_too_large"
        )
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_request_bytes:
            return await error_response(too_large, self.error_shapes, scope["path"])(
                scope, receive, send_with_id
            )
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.read_timeout):  # for the whole body: trickling does not reset it
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
                    if size > self.max_request_bytes:
                        return await error_response(too_large, self.error_shapes, scope["path"])(
                            scope, receive, send_with_id
                        )
        except TimeoutError:
            slow = ApiError(
                408,
                f"the request body did not arrive within {self.read_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            )
            return await error_response(slow, self.error_shapes, scope["path"])(scope, receive, send_with_id)
        body = b"".join(chunks)
        state["received"] = time.monotonic()  # the body is here: the server's own time on the request starts
        try:
            body.decode()  # JSON is UTF-8; say so rather than FastAPI's "error parsing the body"
        except UnicodeDecodeError:
            not_utf8 = ApiError(400, "the body is not valid UTF-8")
            return await error_response(not_utf8, self.error_shapes, scope["path"])(
                scope, receive, send_with_id
            )
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send_with_id)


def headless(send):
    """`send` for a HEAD request answered as its GET: the GET's status and headers (Content-Length included, as
    HTTP has it), no body. The server's own scope still says HEAD, so it expects none."""

    async def send_headers_only(message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_headers_only
