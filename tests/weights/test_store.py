"""Where weights live: override, environment, source checkout, user cache; never site-packages."""

from pathlib import Path

import pytest

from weights import store


@pytest.mark.timeout(10)
def test_override_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_WEIGHTS_DIR", str(tmp_path / "env"))
    assert store.weights_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert store.weights_dir() == tmp_path / "env"


@pytest.mark.timeout(10)
def test_source_checkout_uses_repository_folder(monkeypatch):
    monkeypatch.delenv("KVSERVE_WEIGHTS_DIR", raising=False)
    repo_weights = Path(store.__file__).resolve().parent
    assert (repo_weights.parent / "pyproject.toml").is_file()  # these tests run from a checkout
    assert store.weights_dir() == repo_weights


@pytest.mark.timeout(10)
def test_installed_package_uses_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSERVE_WEIGHTS_DIR", raising=False)
    installed = tmp_path / "site-packages" / "weights"
    installed.mkdir(parents=True)
    monkeypatch.setattr(store, "__file__", str(installed / "store.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert store.weights_dir() == tmp_path / "cache" / "kvserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store.weights_dir() == tmp_path / "home" / ".cache" / "kvserve"
