"""What the tests of real agent CLIs (Claude Code, Codex) share: the pinned npm package, installed once into the
user's cache folder, and an ASGI recorder in front of kvserve that keeps every exchange."""

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


def npm_command(package: str, version: str, command: str) -> Path:
    """The path of `command` from the npm package `package@version`, installed once under the user's cache
    folder (~/.cache/kvserve/npm), never into the repository."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    prefix = cache / "kvserve" / "npm" / f"{package.rsplit('/', 1)[-1]}-{version}"
    path = prefix / "node_modules" / ".bin" / command
    if not path.exists():
        npm = shutil.which("npm")
        assert npm, f"npm is needed to install {package}"
        partial = prefix.with_name(f"{prefix.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        install = [
            npm,
            "install",
            "--prefix",
            str(partial),
            "--no-audit",
            "--no-fund",
            f"{package}@{version}",
        ]
        subprocess.run(install, check=True, timeout=600, capture_output=True)
        partial.replace(prefix)  # the package's links are relative: they survive the rename
    return path


class Recorded:
    """An ASGI app in front of another that keeps each request's method, path, query, headers and body, and the
    response's status and headers. `rewrite(path, body)` may give a JSON request body to send instead (the
    client's own, otherwise unchanged)."""

    def __init__(self, app, rewrite: Callable[[str, dict], dict | None] | None = None):
        self.app = app
        self.rewrite = rewrite
        self.exchanges: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = {
            "method": scope["method"],
            "path": scope["path"],
            "query": scope["query_string"].decode(),
            "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
            "body": b"",
        }
        self.exchanges.append(exchange)
        if self.rewrite is not None and scope["method"] == "POST":
            scope, receive = await self._rewritten(scope, receive)

        async def receiving():
            message = await receive()
            exchange["body"] += message.get("body", b"")
            return message

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                exchange["status"] = message["status"]
                exchange["response_headers"] = {k.decode(): v.decode() for k, v in message.get("headers", [])}
            await send(message)

        await self.app(scope, receiving, sending)

    def bodies(self, path: str, since: int = 0) -> list[dict]:
        """The JSON bodies posted to `path`, from exchange `since` on."""
        return [json.loads(x["body"]) for x in self.exchanges[since:] if x["path"] == path]

    async def _rewritten(self, scope, receive):
        """The request read whole and given again, rewritten if `rewrite` says so."""
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        request = self.rewrite(scope["path"], json.loads(body)) if body else None
        if request is not None:
            body = json.dumps(request).encode()
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        given = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive_again():
            return given.pop() if given else await receive()

        return scope, receive_again
