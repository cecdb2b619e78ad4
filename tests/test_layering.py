"""Imports point one way: server/cli -> server/api -> server/engine -> model; weights/ and client/ (the HTTP
clients) stand alone."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package prefix -> module prefixes it must never import
FORBIDDEN = {
    "model": [
        "server",
        "weights",
        "client",
        "fastapi",
        "pydantic",
        "asyncio",
        "prometheus_client",
        "uvicorn",
    ],
    "server/engine": [
        "server.api",
        "server.cli",
        "fastapi",
        "pydantic",
        "prometheus_client",
        "uvicorn",
        "weights",
        "client",
    ],
    "server/api": ["server.cli", "weights", "client"],
    "weights": ["model", "server", "client"],
    "client": ["model", "server", "weights", "torch"],
}


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.timeout(30)
@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no python files under {package}"
    bad = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in files
        for name in imports_of(f)
        if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[package])
    ]
    assert not bad, "\n".join(bad)
