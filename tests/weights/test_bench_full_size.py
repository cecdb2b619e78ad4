"""scripts/bench_full_size.py's own arithmetic and log reading (the servers themselves it runs by hand: the README's
Benchmarks)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from model.config import ModelConfig
from model.kv_cache import KVCache
from tests.helpers.gguf_writers import tiny_hf_model, write_llama_cpp_gguf
from weights.gguf_source import GGUFSource

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_full_size.py"


@pytest.fixture(scope="module")
def bench_script():
    spec = importlib.util.spec_from_file_location("bench_full_size", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["qwen3moe", "olmoe"])
def test_the_kv_it_asks_for_is_what_kvserve_makes_of_it(tmp_path, byte_vocab, bench_script, family):
    """--kv-cache-memory is the context's tokens at the script's bytes per token: exactly kvserve's blocks, so that
    kvserve's cache holds the context and no more, as llama.cpp's `-c` does."""
    tiny_hf_model(family, len(byte_vocab["tokens"])).save_pretrained(tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_llama_cpp_gguf(tmp_path / "hf", path, byte_vocab, GGMLQuantizationType.Q8_0)
    source = GGUFSource(path)
    config = ModelConfig.from_dict(source.config, source.generation_config)
    per_block = KVCache.bytes_per_block(config, 16, torch.bfloat16)
    assert bench_script.kv_bytes_per_token(str(path)) * 16 == per_block


def test_the_kv_each_server_reports_is_read_from_its_log(bench_script):
    kvserve = "2026-11-29 05:35:42,306 INFO server.engine.setup: KV cache: 512 blocks of 16 tokens (0.50 GiB, bfloat16)"
    llama = (
        "0.06.500.539 I llama_kv_cache: size =  768.00 MiB (  8192 cells,  48 layers,  1/1 seqs), "
        "K (f16):  384.00 MiB, V (f16):  384.00 MiB"
    )
    assert bench_script.kv_from_log("kvserve", "before\n" + kvserve + "\nafter") == 0.5
    assert bench_script.kv_from_log("llama.cpp", llama) == 0.75
    assert bench_script.kv_from_log("llama.cpp", "no such line") is None
