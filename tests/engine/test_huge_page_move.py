"""The CPU backend's move of the weights onto 2 MiB pages (server/engine/backend.py): done when the engine is
built, before any step (beside running requests it took a core's share from them)."""

import logging

import pytest

from server.engine.config import EngineConfig
from server.engine.engine import Engine
from tests.model.test_huge_pages import anon_huge_bytes, skip_without_huge_pages

pytestmark = pytest.mark.slow


def test_an_engine_on_cpu_has_its_weights_on_huge_pages_before_its_first_step(default_model_dir, caplog):
    skip_without_huge_pages()
    with caplog.at_level(logging.INFO, logger="server.engine.backend"):
        engine = Engine(str(default_model_dir), EngineConfig(kv_cache_memory=64 << 20, max_num_seqs=2))
    # logged by the time the engine is built
    assert any("on 2 MiB pages" in r.message for r in caplog.records)
    packed = [b for name, b in engine.runner.model.named_buffers() if name.split(".")[-1] == "packed"]
    if not packed:
        pytest.skip("the C++ kernels could not be built here: no packed weights")
    # the default model's packed weights are all under 2 MiB: carved side by side from shared regions
    total = sum(b.nbytes for b in packed)
    start, end = min(b.data_ptr() for b in packed), max(b.data_ptr() + b.nbytes for b in packed)
    assert anon_huge_bytes(start, end) >= total // 2
