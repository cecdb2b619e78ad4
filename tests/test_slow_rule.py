"""The rule of tests/conftest.py that keeps `make test-fast` fast: a test that needs the real model, a browser, a
container or a live replica without the `slow` marker fails, saying so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REAL_WEIGHTS, heavy_process

REPO = Path(__file__).resolve().parents[1]

CASES = """
import subprocess
import sys

import pytest

from tests.conftest import REAL_WEIGHTS
from weights import fetch


def test_asks_for_the_real_model(default_model_dir):
    pass


@pytest.mark.slow
def test_asks_for_it_marked(default_model_dir):
    assert default_model_dir == "stand-in"


def test_fetches_the_real_model_itself():
    fetch.ensure_default_model(REAL_WEIGHTS)


def test_fetches_into_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "is_complete", lambda folder: True)  # nothing is downloaded
    assert fetch.ensure_default_model(tmp_path) == tmp_path / "smollm2-135m-instruct"


def test_starts_a_replica(tmp_path):
    subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tmp_path)])


def test_starts_a_container():
    subprocess.run(["podman", "run", "--rm", "kvserve:cpu"])


def test_runs_a_plain_command():
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).returncode == 0
"""

# The rule as the suite has it, and a stand-in for the real model: the marked test passes without a download.
CONFTEST = """
import pytest

from tests.conftest import *  # noqa: F403


@pytest.fixture
def default_model_dir():
    return "stand-in"
"""


@pytest.mark.slow  # a subprocess or more of a few seconds: make test, not test-fast
@pytest.mark.timeout(120)
def test_unmarked_heavy_tests_fail_with_the_reason(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_cases.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    outcomes = {  # the short summary: "FAILED test_cases.py::test_x - Failed: ..."
        line.split()[1].split("::")[1]: line.split()[0]
        for line in run.stdout.splitlines()
        if line.startswith(("PASSED ", "FAILED ", "ERROR "))
    }
    assert outcomes == {
        "test_asks_for_the_real_model": "ERROR",  # in setup, before the fixture runs
        "test_asks_for_it_marked": "PASSED",
        "test_fetches_the_real_model_itself": "FAILED",
        "test_fetches_into_its_own_folder": "PASSED",
        "test_starts_a_replica": "FAILED",
        "test_starts_a_container": "FAILED",
        "test_runs_a_plain_command": "PASSED",
    }, run.stdout[-3000:]
    for what in ("the real default model", "a live `kvserve serve` replica", "a container engine"):
        assert f"needs {what} but is not marked slow: mark it @pytest.mark.slow" in run.stdout, what


@pytest.mark.parametrize(
    "command, what",
    [
        (
            [sys.executable, "-m", "server.cli", "serve", "--model", "/tmp/tiny"],
            "a live `kvserve serve` replica",
        ),
        (["/venv/bin/kvserve", "serve"], "a live `kvserve serve` replica"),
        (
            [sys.executable, "-m", "server.cli", "generate", "--model", str(REAL_WEIGHTS / "m")],
            "the real default model",
        ),
        ([sys.executable, "-m", "server.cli", "generate", "--model", "/tmp/tiny"], None),
        ([sys.executable, "-m", "server.cli", "openapi"], None),
        ([sys.executable, "-m", "server.cli", "serve", "--help"], None),
        (["podman", "--cgroup-manager", "cgroupfs", "build", "."], "a container engine"),
        (["bash", "scripts/image.sh", "build", "cpu"], "a container engine"),
        ("docker ps", "a container engine"),
        (["/usr/bin/chromedriver", "--port=0"], "a browser"),
        (["git", "ls-files"], None),
        ([sys.executable, "-c", "print('serve')"], None),
    ],
)
def test_heavy_processes_are_recognised(command, what):
    assert heavy_process(command) == what
