"""What the deployment tests share: the repository's paths, a small Dockerfile reader and the venv's tools.

No Docker engine runs here, so the Dockerfiles are read as text: continuation lines joined, comments dropped,
one (INSTRUCTION, arguments) pair per instruction.
"""

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the instruction, continuation lines joined

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD, or None for shell form."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index(" CMD ") + 5 :] if " CMD " in text else ""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def parse_dockerfile(path: Path) -> list[Instruction]:
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):  # comments may sit between continuation lines too
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].strip() + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path}: the last instruction ends in a line continuation"
    return instructions


def venv_tool(name: str) -> str:
    """A console script of the test extras: next to the running interpreter first (a venv need not be on PATH)."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` not found: install the test extras (bash scripts/install.sh --test)")
    return found
