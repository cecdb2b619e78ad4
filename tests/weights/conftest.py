"""Fixtures of the GGUF tests: trained vocabularies (tests/helpers/gguf_writers.py writes the files) and the GGUF
the default model came from."""

from pathlib import Path

import pytest

from tests.helpers.gguf_writers import byte_level_vocab, sentencepiece_vocab


@pytest.fixture(scope="session")
def byte_vocab() -> dict:
    return byte_level_vocab("llama-bpe")


@pytest.fixture(scope="session")
def spm_vocab() -> dict:
    return sentencepiece_vocab()


@pytest.fixture(scope="session")
def default_gguf(default_model_dir: Path) -> Path:
    """The GGUF that ensure_default_model keeps next to the converted default model."""
    return default_model_dir.parent / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
