"""The chat page over plain HTTP: what is served, with which headers, to whom; the browser tests are in
test_chat_page.py."""

import hashlib
import re
import tomllib
from pathlib import Path, PurePosixPath

import httpx

from server import cli, commands
from server.api.app import create_app
from server.api.config import ServerConfig
from server.api.openapi import openapi_yaml
from server.api.ui import FILES, STATIC

KEY = "sk-kvserve-ui-test-51d2"


def csp(response: httpx.Response) -> dict[str, str]:
    policy = response.headers["content-security-policy"]
    directives = (part.strip().split(None, 1) for part in policy.split(";") if part.strip())
    return {d[0]: d[1] if len(d) > 1 else "" for d in directives}


def test_page_and_its_files_with_a_strict_content_security_policy(tiny_engine, start_server):
    url, _ = start_server(tiny_engine)
    page = httpx.get(f"{url}/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    policy = csp(page)
    # Scripts, styles and connections from this origin only: no inline code, no eval, no other host.
    assert policy["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src", "img-src"):
        assert policy[directive] == "'self'", directive
    assert policy["frame-ancestors"] == "'none'" and policy["base-uri"] == "'none'"
    assert policy["require-trusted-types-for"] == "'script'"
    assert not re.search(r"unsafe|https?:|\*|data:", page.headers["content-security-policy"])
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"

    # The page holds no inline script or style, and loads nothing from elsewhere.
    html = page.text
    assert not re.search(r"<script(?![^>]*\bsrc=)", html), "an inline <script>"
    assert "<style" not in html and " style=" not in html, "inline style"
    assert not re.search(r"\bon[a-z]+=", html), "an inline event handler"
    assert not re.search(r"(src|href)=\"(https?:)?//", html), "a remote resource"
    referenced = re.findall(r"(?:src|href)=\"ui/([^\"]+)\"", html)
    assert {"app.js", "style.css", "favicon.svg"} <= set(referenced)
    app_js = httpx.get(f"{url}/ui/app.js")
    imported = re.findall(r"from \"\./([^\"]+)\"", app_js.text)
    assert imported == ["vendor/markdown-it.esm.min.mjs"]
    for name in referenced + imported:
        r = httpx.get(f"{url}/ui/{name}")
        assert r.status_code == 200, name
        assert r.content == (STATIC / name).read_bytes()
        assert r.headers["content-security-policy"] == page.headers["content-security-policy"]
    assert httpx.get(f"{url}/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert (
        httpx.get(f"{url}/ui/vendor/markdown-it.esm.min.mjs")
        .headers["content-type"]
        .startswith("text/javascript")
    )
    # the vendored library ships with its license
    assert "vendor/markdown-it.LICENSE.txt" in FILES
    assert "MIT" in httpx.get(f"{url}/ui/vendor/markdown-it.LICENSE.txt").text


def test_only_the_shipped_files_are_served(tiny_engine, start_server, tiny_llama_dir):
    url, _ = start_server(tiny_engine)
    for name in [
        "../app.py",
        "..%2Fapp.py",
        "%2e%2e/ui.py",
        "/etc/passwd",
        "nothing.js",
        "",
        str(tiny_llama_dir),
    ]:
        r = httpx.get(f"{url}/ui/{name}")
        assert r.status_code == 404, name  # an OpenAI-shaped error, never a file's bytes
        assert set(r.json()) == {"error"}, name
    assert httpx.post(f"{url}/", json={}).status_code == 405


def test_page_is_public_with_an_api_key_and_holds_no_secret(tiny_engine, start_server):
    url, _ = start_server(tiny_engine, api_key=KEY)
    for path in ["/", *(f"/ui/{name}" for name in FILES)]:
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 200, path
        assert KEY not in r.text, path
    assert httpx.get(f"{url}/v1/models").status_code == 401  # the API stays guarded
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_no_ui_turns_the_page_off(tiny_engine, start_server, monkeypatch):
    url, _ = start_server(tiny_engine, ui=False)
    for path in ["/", "/ui/app.js"]:
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{url}/health").status_code == 200

    def config(*flags: str) -> ServerConfig:
        parsed = {}
        monkeypatch.setattr(cli, "cmd_serve", lambda args: parsed.setdefault("args", args) and 0)
        cli.main(["serve", *flags])  # parses the flags; serves nothing
        return commands.server_config(parsed["args"], None)

    assert config().ui is True
    assert config("--no-ui").ui is False
    monkeypatch.setenv("KVSERVE_NO_UI", "1")
    assert config().ui is False


def test_the_page_is_not_in_the_openapi_document():
    with_page = openapi_yaml(create_app(None, ServerConfig(ui=True)))
    assert with_page == openapi_yaml(create_app(None, ServerConfig(ui=False)))
    assert "/ui/" not in with_page and "\n  /:\n" not in with_page


def test_every_page_file_is_package_data():
    """A wheel (not only an editable install) carries the page: pyproject's package-data names every file."""
    root = Path(__file__).resolve().parents[2]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["server.api"]
    for name in FILES:
        assert any(PurePosixPath("static", name).match(g) for g in globs), name


def test_the_vendored_library_is_the_one_the_readme_names():
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256((STATIC / "vendor/markdown-it.esm.min.mjs").read_bytes()).hexdigest()
    readme = (root / "README.md").read_text()
    assert f"sha256 `{digest}`" in readme and "markdown-it@15.0.3" in readme
    assert (STATIC / "vendor/markdown-it.esm.min.mjs").read_text().startswith("/*! markdown-it 15.0.3 ")
