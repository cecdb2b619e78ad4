"""The chat page: `GET /` and its files under `/ui/`, shipped in the package (server/api/static), no build step.

The page talks to this server's own OpenAI routes, so it needs nothing but the same origin. It is public even
with an API key (it holds no secret: the key is typed into the browser and kept there); the API stays guarded.
Every response carries a Content-Security-Policy that allows scripts, styles and connections from this origin
only, no inline script or style, and HTML sinks only through the page's one Trusted Types policy: model output
is rendered as Markdown with raw HTML off, and even a renderer bug could not run script or reach another host.
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.api.errors import ApiError

STATIC = Path(__file__).parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self'",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
    "require-trusted-types-for 'script'",
    "trusted-types kvserve-markdown",
])  # fmt: skip
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # small files; a new kvserve's page is never mixed with an old one's
}
# The files are listed once, at import: a request picks one by name and can never name a path of its own.
FILES = {
    str(path.relative_to(STATIC)): path
    for path in sorted(STATIC.rglob("*"))
    if path.is_file() and path.suffix in MEDIA_TYPES
}

ui_router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    path = FILES.get(name)
    if path is None:
        raise ApiError(404, f"no file {name[:100]!r} in the chat page", "not_found_error", code="not_found")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


@ui_router.get("/")
def chat_page() -> FileResponse:
    return _file("index.html")


@ui_router.get("/ui/{name:path}")
def chat_page_file(name: str) -> FileResponse:
    return _file(name)
