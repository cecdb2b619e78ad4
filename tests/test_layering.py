"""Imports point one way: server/cli (+ server/commands) -> server/api -> server/engine -> model; weights/ and
client/ (the HTTP clients) stand alone; server/bench (the benchmarks and load tools the CLI runs) drives the engine
in process or a server over HTTP (client/), never the API's insides."""

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
        "server.commands",
        "fastapi",
        "pydantic",
        "prometheus_client",
        "uvicorn",
        "weights",
        "client",
    ],
    "server/api": ["server.cli", "server.commands", "weights", "client"],
    "server/bench": [
        "server.api",
        "server.cli",
        "server.commands",
        "fastapi",
        "pydantic",
        "prometheus_client",
        "uvicorn",
        "weights",
    ],
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


# The tools that only talk HTTP, to any OpenAI-compatible server: nothing of kvserve's model or engine loads.
HTTP_TOOLS = ("http", "soak", "workloads")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", HTTP_TOOLS)
def test_the_http_tools_load_no_model(name):
    f = ROOT / "server" / "bench" / f"{name}.py"
    no = ("model", "server.engine", "server.bench.offline", "server.bench.spec", "torch")
    bad = [m for m in imports_of(f) if any(m == n or m.startswith(n + ".") for n in no)]
    assert not bad, f"{f.relative_to(ROOT)} imports {', '.join(bad)}"


# What the API may see of the engine: its client (AsyncEngine) and the plain records it hands out.
ENGINE_CLIENT = {"server.engine.async_engine", "server.engine.request", "server.engine.stats"}


@pytest.mark.timeout(30)
def test_the_api_talks_to_the_engine_client_only():
    files = sorted((ROOT / "server" / "api").rglob("*.py"))
    bad = []
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for name in imports_of(f):
            if name == "model" or name.startswith("model."):
                bad.append(f"{f.relative_to(ROOT)} imports {name} (the model is two floors down)")
            elif name.startswith("server.engine") and name not in ENGINE_CLIENT:
                bad.append(f"{f.relative_to(ROOT)} imports {name} (past the engine client)")
        for node in ast.walk(tree):  # nor reaches into the client's private parts (x.engine._engine)
            if isinstance(node, ast.Attribute) and node.attr == "_engine":
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno} reads ._engine")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("package", ["model", "server/engine", "server/api", "weights"])
def test_no_import_circles_inside_a_package(package):
    """Modules of one package import each other one way (imports under TYPE_CHECKING count too: a circle that
    only type hints need is still two modules that cannot be read apart)."""
    files = sorted((ROOT / package).rglob("*.py"))
    module = {f: ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for f in files}
    names = set(module.values())
    graph = {module[f]: {n for n in imports_of(f) if n in names and n != module[f]} for f in files}
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after

    def circle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := circle_from(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := circle_from(start, [start])):
            pytest.fail(" -> ".join(found))


# Each API's package (server/api/<name>/) uses the shared modules of server/api and never another API's; the
# shared modules use no API's, the server's own routes (routes.py, fleet.py, scoring.py) included: their bodies
# are on the shared floor (protocol.py). Only the assembly sees the APIs: app.py and openapi.py.
APIS = ("openai", "anthropic")
SHARED = (
    "blocks",
    "config",
    "errors",
    "fleet",
    "metrics",
    "middleware",
    "prompt",
    "protocol",
    "routes",
    "scoring",
    "serving",
    "shape",
    "structured",
    "tools",
)


@pytest.mark.timeout(30)
def test_each_api_stands_apart():
    api = ROOT / "server" / "api"
    bad = []
    for name in APIS:
        others = [f"server.api.{other}" for other in APIS if other != name]
        for f in sorted((api / name).rglob("*.py")):
            bad += [
                f"{f.relative_to(ROOT)} imports {m}" for m in imports_of(f) if m.startswith(tuple(others))
            ]
    for name in SHARED:
        f = api / f"{name}.py"
        apis = tuple(f"server.api.{a}" for a in APIS)
        bad += [f"{f.relative_to(ROOT)} imports {m}" for m in imports_of(f) if m.startswith(apis)]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(30)
def test_the_pipeline_is_one_name():
    """An endpoint (and whatever else runs requests) imports one name of the serving pipeline, Serving, and
    calls its methods; what an answer looks like comes from shape.py."""
    api = ROOT / "server" / "api"
    bad = []
    for f in sorted(api.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module == "server.api.serving":
                names = [a.name for a in node.names]
                if names != ["Serving"]:
                    bad.append(f"{f.relative_to(ROOT)} imports {', '.join(names)} from server.api.serving")
            elif isinstance(node, ast.ImportFrom) and node.module == "server.api" and node.level == 0:
                if any(a.name == "serving" for a in node.names):
                    bad.append(f"{f.relative_to(ROOT)} imports the module server.api.serving")
    assert not bad, "\n".join(bad)


# Where the GPU is spoken of: the backend (server/engine/backend.py), its decode graphs and the host-to-device copy.
CUDA_PLACES = {"server/engine/backend.py", "server/engine/decode_graphs.py", "model/device.py"}


@pytest.mark.timeout(30)
def test_the_cuda_code_lives_in_the_backend():
    """Nothing in the model or the engine but those names CUDA (`torch.cuda`, `.cuda()`, "cuda"), and nothing
    in the engine but the backend branches on a device's type: a device's choices are its backend's, made once."""
    bad = []
    for package in ("model", "server/engine"):
        for f in sorted((ROOT / package).rglob("*.py")):
            name = str(f.relative_to(ROOT))
            if name in CUDA_PLACES:
                continue
            for node in ast.walk(ast.parse(f.read_text(), name)):
                if isinstance(node, ast.Attribute) and node.attr == "cuda":
                    bad.append(f"{name}:{node.lineno} reads .cuda")
                elif isinstance(node, ast.Constant) and node.value == "cuda":
                    bad.append(f'{name}:{node.lineno} names "cuda"')
                elif package == "server/engine" and isinstance(node, ast.Attribute) and node.attr == "type":
                    if isinstance(node.value, ast.Attribute) and node.value.attr == "device":
                        bad.append(f"{name}:{node.lineno} branches on a device's type")
    assert not bad, "\n".join(bad)
