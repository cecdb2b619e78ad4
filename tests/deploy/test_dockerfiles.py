"""The Dockerfiles, checked without a Docker engine: hadolint, the runtime contract (port, user, health check,
exec form, environment), the layer order, the build context .dockerignore leaves, and the fetch step run here."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.deploy_files import DOCKERFILES, REPO, Instruction, parse_dockerfile, venv_tool

pytestmark = pytest.mark.parametrize("name", sorted(DOCKERFILES))

SOURCE_PACKAGES = ("model", "server", "weights")


def instructions(name: str) -> list[Instruction]:
    return parse_dockerfile(DOCKERFILES[name])


def find(items: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in items if i.keyword == keyword]


def key_values(items: list[Instruction], keyword: str) -> dict[str, str]:
    """ENV/ARG as a dict (`K=V` pairs; a bare ARG name maps to '')."""
    out = {}
    for i in find(items, keyword):
        for word in shlex.split(i.args):
            key, _, value = word.partition("=")
            out[key] = value
    return out


def install_runs(items: list[Instruction]) -> list[tuple[int, Instruction]]:
    return [(n, i) for n, i in enumerate(items) if i.keyword == "RUN" and "scripts/install.sh" in i.args]


@pytest.mark.timeout(60)
def test_hadolint_passes_at_warning_level(name):
    path = DOCKERFILES[name]
    result = subprocess.run(
        [venv_tool("hadolint"), "--no-color", "--failure-threshold", "warning", str(path)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, f"hadolint {path}:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(10)
def test_runtime_contract(name):
    items = instructions(name)
    base = find(items, "FROM")[-1].args
    if name == "cpu":
        assert re.match(r"python:3\.1[1-9][.\d]*-slim", base), base
    else:
        assert re.match(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-", base), base

    assert ["8000"] == [i.args for i in find(items, "EXPOSE")]
    env = key_values(items, "ENV")
    assert env.get("KVSERVE_HOST") == "0.0.0.0", "the server must listen beyond the container's loopback"
    assert env.get("KVSERVE_WEIGHTS_DIR") == "/models"
    assert key_values(items, "ARG").get("FETCH_DEFAULT_MODEL") == "1"

    user = find(items, "USER")[-1].args.split(":")[0]
    assert user not in ("root", "0"), "the server must not run as root"
    assert user.isdigit(), "a numeric USER lets Kubernetes' runAsNonRoot verify it"

    (healthcheck,) = find(items, "HEALTHCHECK")
    command = healthcheck.exec_form()
    assert command and "/health" in " ".join(command), healthcheck.args
    start = re.search(r"--start-period=(\d+)s", healthcheck.args)
    assert start and int(start.group(1)) >= 120, "the start period must cover a first model load"

    # Exec form: no /bin/sh -c in between, so docker stop's SIGTERM reaches the server, which drains.
    (entrypoint,) = find(items, "ENTRYPOINT")
    (cmd,) = find(items, "CMD")
    assert entrypoint.exec_form() == ["kvserve"], entrypoint.args
    assert cmd.exec_form() and cmd.exec_form()[0] == "serve", cmd.args
    if name == "cuda":
        assert "--device auto" in " ".join(cmd.exec_form()), "the CUDA image takes the GPU when there is one"


@pytest.mark.timeout(10)
def test_dependencies_install_before_the_source_through_the_install_script(name):
    items = instructions(name)
    runs = install_runs(items)
    assert [("--deps-only" in i.args) for _, i in runs] == [True, False], [i.args for _, i in runs]
    (deps_at, _), (project_at, _) = runs

    copies = [(n, shlex.split(i.args)) for n, i in enumerate(items) if i.keyword == "COPY"]
    # Before the dependency layer: nothing but what it needs, so source edits leave it cached.
    early = {src for n, words in copies if n < deps_at for src in words[:-1] if not src.startswith("--")}
    assert early == {"pyproject.toml", "scripts/install.sh"}, early
    copied_before_project = {
        src.rstrip("/")
        for n, words in copies
        if n < project_at
        for src in words[:-1]
        if not src.startswith("--")
    }
    assert set(SOURCE_PACKAGES) <= copied_before_project, "the project install needs every package"
    assert "README.md" in copied_before_project, "pyproject.toml's readme must be in the image for pip"

    args = key_values(items, "ARG")
    index = args.get("TORCH_INDEX_URL", "")
    expected = r"/whl/cpu" if name == "cpu" else r"/whl/cu\d+"
    assert re.fullmatch(r"https://download\.pytorch\.org" + expected, index), index
    script = (REPO / "scripts/install.sh").read_text()
    for variable in ("TORCH_INDEX_URL", "TORCH_SPEC"):
        assert variable in args and variable in script, f"{variable} is the install script's override"


@pytest.mark.timeout(30)
def test_build_context_has_the_source_and_no_weights(name):
    items = instructions(name)
    context = build_context(REPO)
    sources = [
        src.rstrip("/")
        for i in find(items, "COPY")
        for src in shlex.split(i.args)[:-1]
        if not src.startswith("--")
    ]
    for src in sources:
        assert any(p == src or p.startswith(src + "/") for p in context), (
            f"COPY {src}: not in the build context"
        )

    wanted = {
        str(p.relative_to(REPO))
        for package in SOURCE_PACKAGES
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert wanted - context == set(), "sources left out by .dockerignore"
    leaked = [
        p
        for p in context
        if {".git", ".venv", "__pycache__"} & set(Path(p).parts)
        or p.endswith((".safetensors", ".gguf", ".whl"))
    ]
    assert leaked == [], leaked[:10]
    size = sum((REPO / p).stat().st_size for p in context)
    assert size < 20 << 20, f"build context is {size >> 20} MiB: weights or caches are getting in"


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(120)
def test_fetch_step_runs_against_a_weights_dir(name, tmp_path):
    """The build-time fetch, run here on a folder that already holds a (stub) model: the code it calls exists
    and it honours KVSERVE_WEIGHTS_DIR (without downloading anything)."""
    from weights.fetch import GGUF_MEMBER

    (fetch,) = [i for i in find(instructions(name), "RUN") if "FETCH_DEFAULT_MODEL" in i.args]
    code = re.search(r'python -c "([^"]+)"', fetch.args)
    assert code, fetch.args
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / Path(GGUF_MEMBER).name).write_text("{}")  # the GGUF `kvserve serve` reads in place
    env = {**os.environ, "KVSERVE_WEIGHTS_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)], cwd=REPO, env=env, capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"], "it must not download"
    assert len(list((tmp_path / "gguf").iterdir())) == 1


@pytest.mark.timeout(120)
def test_environment_names_are_serve_flags(name):
    """Every KVSERVE_* the deployment files set is a flag of `kvserve serve` (flags read KVSERVE_<FLAG>)."""
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, f"`kvserve serve --help` failed:\n{result.stderr}"
    flags = set(re.findall(r"--([a-z][a-z0-9-]*)", result.stdout))
    # The image's ENV and the compose/Kubernetes files (RUN lines also set the install script's KVSERVE_VENV).
    names = set(key_values(instructions(name), "ENV"))
    for path in (REPO / "docker").rglob("*.yaml"):
        names.update(re.findall(r"\b(KVSERVE_[A-Z_]+)\b", path.read_text()))
    used = {n.removeprefix("KVSERVE_").lower().replace("_", "-") for n in names if n.startswith("KVSERVE_")}
    assert used, "no KVSERVE_ settings found"
    assert used - flags == set(), f"not flags of `kvserve serve`: {sorted(used - flags)}"
    for flag in re.findall(r'"(--[a-z-]+)"', DOCKERFILES[name].read_text()):
        assert flag.removeprefix("--") in flags, f"CMD uses {flag}, which `kvserve serve` lacks"


def build_context(root: Path) -> set[str]:
    """The files `docker build` sends from `root`, following .dockerignore the way Docker reads it: patterns
    are cleaned paths, `*` and `?` stop at `/`, `**` spans folders, a pattern that matches a folder takes
    everything under it, and the last matching pattern wins (`!` takes a path back)."""
    rules = []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((keep, re.compile(glob_regex(pattern)), pattern))

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        verdict = False
        for keep, regex, _ in rules:
            if any(regex.fullmatch(p) for p in prefixes):
                verdict = not keep
        return verdict

    def may_take_back(folder: str) -> bool:
        return any(keep and pattern.startswith(folder + "/") for keep, _, pattern in rules)

    files = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel + "/"
        dirnames[:] = [d for d in dirnames if not ignored(rel + d) or may_take_back(rel + d)]
        files.update(rel + f for f in filenames if not ignored(rel + f))
    return files


def glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out
