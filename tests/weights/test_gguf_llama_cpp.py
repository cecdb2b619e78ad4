"""The GGUF writer the other tests use (tests/helpers/gguf_writers.py) against llama.cpp's own converter, and
kvserve's conversion of the real converter's output.

Runs llama.cpp's own Python converter (convert_hf_to_gguf.py, conversion/, gguf-py/) from a llama.cpp source
tree: KVSERVE_LLAMA_CPP or /tmp/peer/llama.cpp where there is one, else the tree vendored by llama-cpp-python's
sdist (77 MB, the peer build's pinned version), downloaded once into the user's cache folder (pip download,
never installed; not under weights/, whose *.py files are kvserve's package).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tests.helpers.gguf_writers import TINY_FAMILIES, prompt_ids, tiny_hf_model, write_llama_cpp_gguf
from weights.gguf_convert import convert_gguf

SDIST = "llama-cpp-python==0.3.36"
DRIVER = Path(__file__).parents[1] / "helpers" / "llama_cpp_convert.py"  # run as a script, never imported

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_cpp_tree() -> Path:
    """A llama.cpp source llama_cpp_tree holding its Python converter."""
    import tarfile
    import tempfile

    for candidate in (os.environ.get("KVSERVE_LLAMA_CPP"), "/tmp/peer/llama.cpp"):
        if candidate and (Path(candidate) / "conversion").is_dir():
            return Path(candidate)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    vendored = cache / "kvserve" / "llama-cpp-converter" / SDIST.replace("==", "-")
    if not (vendored / "conversion").is_dir():
        with tempfile.TemporaryDirectory() as download:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                       "-d", download, SDIST]  # fmt: skip
            subprocess.run(command, check=True, timeout=600)
            (archive,) = Path(download).glob("*.tar.gz")
            with tarfile.open(archive) as tar:
                root = tar.getnames()[0].split("/")[0]
                prefix = f"{root}/vendor/llama.cpp/"
                members = [
                    m for m in tar.getmembers() if m.name.startswith(prefix) and m.name.endswith(".py")
                ]
                for member in members:
                    member.name = member.name.removeprefix(prefix)
                tar.extractall(vendored.with_suffix(".partial"), members, filter="data")
            vendored.with_suffix(".partial").replace(vendored)
    return vendored


def model_metadata(reader: GGUFReader) -> dict:
    """The metadata that describes the model (not the tokenizer, the file type or the writer's own notes)."""
    arch = reader.fields["general.architecture"].contents()
    return {
        k: f.contents()
        for k, f in reader.fields.items()
        if k.startswith(f"{arch}.") or k == "general.architecture"
    }


def convert_both_ways(llama_cpp_tree, tmp_path, vocab, family, outtype="f32"):
    """(the model, our GGUF, llama.cpp's GGUF)"""
    model = tiny_hf_model(family, len(vocab["tokens"]))
    model.save_pretrained(tmp_path / "hf")
    # Gemma 3's converter trims the embedding to the tokenizer's vocabulary: give it one as large as the model's
    tokenizer = {"model": {"vocab": {t: i for i, t in enumerate(vocab["tokens"])}}, "added_tokens": []}
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    qtype = GGMLQuantizationType.F32 if outtype == "f32" else GGMLQuantizationType.Q8_0
    write_llama_cpp_gguf(tmp_path / "hf", tmp_path / "ours.gguf", vocab, qtype)
    run = subprocess.run(
        [sys.executable, DRIVER, llama_cpp_tree, tmp_path / "hf", tmp_path / "theirs.gguf", tmp_path / "vocab.json", outtype],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return model, tmp_path / "ours.gguf", tmp_path / "theirs.gguf"


def assert_same_gguf(ours_path: Path, theirs_path: Path) -> None:
    ours, theirs = GGUFReader(ours_path), GGUFReader(theirs_path)
    assert model_metadata(ours) == model_metadata(theirs)
    ours_tensors = {t.name: t for t in ours.tensors}
    theirs_tensors = {t.name: t for t in theirs.tensors}
    assert ours_tensors.keys() == theirs_tensors.keys()
    for name, tensor in theirs_tensors.items():
        mine = ours_tensors[name]
        assert (mine.tensor_type, mine.shape.tolist()) == (tensor.tensor_type, tensor.shape.tolist()), name
        assert np.array_equal(np.asarray(mine.data), np.asarray(tensor.data)), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_llama_cpp_converter_writes_what_the_test_writer_writes(llama_cpp_tree, tmp_path, byte_vocab, family):
    model, ours, theirs = convert_both_ways(llama_cpp_tree, tmp_path, byte_vocab, family)
    assert_same_gguf(ours, theirs)

    # and kvserve's conversion of llama.cpp's own file is the original model
    convert_gguf(theirs, tmp_path / "out", progress=False)
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = prompt_ids(model.config.vocab_size)
    with torch.no_grad():
        assert (converted(ids).logits - model(ids).logits).abs().max() < 1e-5


@pytest.mark.timeout(300)
# qwen2moe: stacked experts quantized, its router and shared expert's gate kept F32; granitemoe: its gate | up split
@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3", "qwen2moe", "granitemoe"])
def test_llama_cpp_q8_0_matches_the_test_writer(llama_cpp_tree, tmp_path, byte_vocab, family):
    assert_same_gguf(*convert_both_ways(llama_cpp_tree, tmp_path, byte_vocab, family, "q8_0")[1:])
