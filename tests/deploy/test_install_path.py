"""One install path: the README's commands, the Makefile, CI and both Dockerfiles all go through
scripts/install.sh, and the script's modes (the Dockerfiles' --deps-only included) install what they claim."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.deploy_files import DOCKERFILES, REPO, parse_dockerfile

SCRIPT = "scripts/install.sh"


def make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """Makefile target -> (prerequisites, recipe lines)."""
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith("\t") and current:
            rules[current][1].append(line.strip())
        elif m := re.match(r"^([\w.-]+)\s*:(?!=)\s*(.*)$", line):
            current = m.group(1)
            rules[current] = (m.group(2).split(), [])
        elif line.strip() and not line.startswith("#"):
            current = None
    return rules


@pytest.mark.timeout(10)
def test_readme_ci_makefile_and_dockerfiles_share_the_install_script():
    readme = REPO / "README.md"
    assert readme.is_file(), "README.md is missing"
    text = readme.read_text()
    for command in ("make test", "make serve"):
        assert command in text, f"README no longer says `{command}`"

    ci = (REPO / ".ci/run").read_text()
    assert re.search(r"^\s*make test\s*$", ci, re.M), ".ci/run must run the README's test command"

    rules = make_rules()
    installs = {t for t, (_, recipe) in rules.items() if any(f"bash {SCRIPT}" in r for r in recipe)}
    assert {"install", "install-test"} <= installs, installs
    assert any("--test" in r for r in rules["install-test"][1])
    assert "install" in rules["serve"][0], "`make serve` must install first"
    assert "install-test" in rules["test"][0], "`make test` must install (with the test extras) first"

    for name, path in DOCKERFILES.items():
        runs = [i.args for i in parse_dockerfile(path) if i.keyword == "RUN" and SCRIPT in i.args]
        assert runs and all(f"bash {SCRIPT}" in r for r in runs), f"{name}: {runs}"


FAKE_PYTHON = """#!{real}
# Stands in for the interpreter install.sh is given: records every call, answers pip, the kernels' build and
# the torch check itself, and hands anything else (the script's inline Python) to the real interpreter.
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if args[:2] in (["-m", "pip"], ["-m", "model.kernels"]):
    sys.exit(0)
if args == ["-c", "import torch"]:
    sys.exit(1 if os.environ.get("FAKE_NO_TORCH") else 0)
os.execv({real!r}, [{real!r}] + args)
"""


def run_install(
    tmp_path: Path, *flags: str, **env: str
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    result, calls = run_install_calls(tmp_path, *flags, **env)
    return result, [c[2:] for c in calls if c[:2] == ["-m", "pip"]]


def run_install_calls(
    tmp_path: Path, *flags: str, **env: str
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """install.sh run with the fake interpreter: its result and every call it made of the interpreter."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    environ = {**os.environ, "KVSERVE_VENV": "", "PYTHON": str(fake), "FAKE_LOG": str(log), **env}
    for name in ("TORCH_INDEX_URL", "TORCH_SPEC"):
        if name not in env:
            environ.pop(name, None)
    result = subprocess.run(
        ["bash", str(REPO / SCRIPT), *flags], env=environ, capture_output=True, text=True, timeout=60
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def project_requirements(extra: bool) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + (project["optional-dependencies"]["test"] if extra else [])


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(60)
def test_install_script_modes(tmp_path):
    def packages(pip_args: list[str]) -> list[str]:
        return [a for a in pip_args if not a.startswith("-")][1:]  # drop "install" and the options

    result, pips = run_install(tmp_path)
    assert result.returncode == 0, result.stderr
    assert [packages(p) for p in pips] == [["."]] and "-e" in pips[0], pips

    result, pips = run_install(tmp_path, "--test")
    assert result.returncode == 0, result.stderr
    assert [packages(p) for p in pips] == [[".[test]"]] and "-e" in pips[0], pips

    # What the Dockerfiles run before copying the source: every requirement, not the project.
    for flags, extra in (
        (["--deps-only"], False),
        (["--deps-only", "--test"], True),
        (["--test", "--deps-only"], True),
    ):
        result, pips = run_install(tmp_path, *flags)
        assert result.returncode == 0, result.stderr
        assert len(pips) == 1 and "-e" not in pips[0], pips
        assert packages(pips[0]) == project_requirements(extra)

    # torch first and from the index the Dockerfiles pass, when it is missing.
    index = "https://download.pytorch.org/whl/cpu"
    result, pips = run_install(
        tmp_path, "--deps-only", FAKE_NO_TORCH="1", TORCH_INDEX_URL=index, TORCH_SPEC="torch==2.13.0"
    )
    assert result.returncode == 0, result.stderr
    assert pips[0][-3:] == ["--index-url", index, "torch==2.13.0"], pips[0]
    assert "torch==2.13.0" not in pips[1]

    result, pips = run_install(tmp_path, "--deps_only")
    assert result.returncode == 2 and pips == [], (
        "an unknown flag must stop the script, not install everything"
    )


@pytest.mark.timeout(60)
def test_make_serve_builds_the_servers_tier_and_make_test_every_tier_the_tests_run(tmp_path, monkeypatch):
    """A first `make serve` waits for one tier's kernels, the one its server runs as (auto); `make test` builds each
    tier this CPU runs, as the kernel tests run them all (and the amx tier where only its tiles are missing);
    KVSERVE_KERNEL_TIERS (the images: all) wins over both; --deps-only builds none."""
    monkeypatch.delenv("KVSERVE_KERNEL_TIERS", raising=False)

    def builds(*flags: str, **env: str) -> list[list[str]]:
        result, calls = run_install_calls(tmp_path, *flags, **env)
        assert result.returncode == 0, result.stderr
        return [c[2:] for c in calls if c[:2] == ["-m", "model.kernels"]]

    # twice: beside pip's install of the rest (a first start waits for both), then once more, which does
    # nothing when that one succeeded and builds again when it failed beside pip
    assert builds() == [["build", "--tiers", "auto"]] * 2
    # the tiers this CPU runs, and those whose tile kernels the tests run on a model of the tiles
    assert builds("--test") == [["build", "--tiers", "test"]] * 2
    everything = [["build", "--tiers", "all"]] * 2
    assert builds(KVSERVE_KERNEL_TIERS="all") == builds("--test", KVSERVE_KERNEL_TIERS="all") == everything
    assert builds("--deps-only") == []
