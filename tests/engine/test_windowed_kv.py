"""Sliding-window layers' K/V freed once it leaves the window (server/engine/block_manager.py's KV groups).

Each family with windows (Mistral's on every layer, Gemma 2's every other one, Gemma 3's five in six, GPT-OSS's with
sinks) through the engine with prompts longer than the window and chunks shorter: the greedy tokens are
transformers', the sliding groups hold no more blocks than the window and a chunk need, and a prefix hit, a
preemption and a batch give the bits a request gets alone.
"""

import pytest
import torch

from model.kv_cache import KVCache
from server.engine.block_manager import blocks_for
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import SamplingParams
from tests.helpers.engine_runs import served_bits
from tests.helpers.tiny_models import reference_model, tiny_family

BLOCK = 4
WINDOWED = [
    "mistral",
    "gemma2",
    "gemma3",
    "gpt_oss",
]  # tiny models with windows of 8 tokens (FAMILY_OVERRIDES)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)


def make_engine(path, **changes) -> Engine:
    config = EngineConfig(kv_cache_memory=1 << 20, block_size=BLOCK, max_num_batched_tokens=12, max_num_seqs=4,
                          dtype="float32", batch_invariant=True)  # fmt: skip
    return Engine(str(path), EngineConfig(**{**config.__dict__, **changes}))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, prompts: dict[str, list[int]]) -> tuple[dict[str, dict], int]:
    return served_bits(engine, prompts, PARAMS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", ["on", "off"])  # attention by the C++ kernel, or PyTorch's gathers
@pytest.mark.parametrize("family", WINDOWED)
def test_a_windowed_model_frees_what_leaves_the_window_and_gives_transformers_tokens(
    tiny_model_factory, family, kernels
):
    path = tiny_family(tiny_model_factory, family)
    engine = make_engine(path, enable_prefix_caching=False, cpu_kernels=kernels)
    windows = list(engine.model_config.kv_group_windows)
    assert any(w is not None for w in windows)
    ids = prompt(40, 0)  # five windows long, prefilled 12 tokens a step
    result, most = run(engine, {"a": ids})
    reference = reference_model(path)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert result["a"]["ids"] == out[0, 40:].tolist()
    total = 40 + 24 - 1  # tokens with K/V: all but the last drawn
    assert most <= blocks_for(windows, BLOCK, total, 12) < len(windows) * -(-total // BLOCK)
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_a_hit_a_preemption_and_a_batch_give_a_windowed_request_its_bits_alone(tiny_model_factory, family):
    """A chat's next turn resumes after its cached history (whose early sliding blocks went back to the pool long
    ago), a request preempted under a small cache recomputes, requests share steps: each one's tokens and logprobs
    are the bits it gets alone without a prefix cache."""
    path = tiny_family(tiny_model_factory, family)
    reference = make_engine(path, enable_prefix_caching=False)

    def alone(ids: list[int]) -> dict:
        return run(reference, {"alone": ids})[0]["alone"]

    engine = make_engine(path)
    turn1 = prompt(30, 1)
    first, _ = run(engine, {"turn1": turn1})
    turn2 = turn1 + first["turn1"]["ids"] + prompt(6, 2)
    second, _ = run(engine, {"turn2": turn2})
    assert second["turn2"]["cached"] >= len(turn1) + 24 - 1 - BLOCK
    for rid, ids in (("turn1", turn1), ("turn2", turn2)):
        got = first.get(rid) or second[rid]
        expected = alone(ids)
        assert got["ids"] == expected["ids"] and got["logprobs"] == expected["logprobs"], rid

    # four long requests in a cache that holds one and a bit: some are preempted and recompute
    per_block = KVCache.bytes_per_block(engine.model_config, BLOCK, torch.float32)
    one = blocks_for(engine.model_config.kv_group_windows, BLOCK, 40 + 24, 12)
    small = make_engine(path, kv_cache_memory=per_block * (one + 8), enable_prefix_caching=False)
    prompts = {f"r{i}": prompt(40, 10 + i) for i in range(4)}
    together, _ = run(small, prompts)
    assert small.scheduler.num_preemptions > 0
    for rid, ids in prompts.items():
        expected = alone(ids)
        assert (
            together[rid]["ids"] == expected["ids"] and together[rid]["logprobs"] == expected["logprobs"]
        ), rid


@pytest.mark.timeout(300)
def test_bench_offline_reports_what_a_sequences_kv_takes(tiny_model_factory):
    """`kvserve bench-offline`'s kv_bytes_per_token_at_peak: Gemma 3's tiny model (1 full layer, 5 sliding of window
    8) at 64 tokens holds the full layer's K/V for every token and the sliding ones' for about a window."""
    from server.bench.offline import bench_offline

    engine = make_engine(tiny_family(tiny_model_factory, "gemma3"))
    config, cache = engine.model_config, engine.runner.kv_cache
    per_layer = (
        2 * config.num_kv_heads * config.head_dim * cache.k.element_size()
    )  # a token's K/V in one layer
    result = bench_offline(engine, num_requests=1, input_len=64, output_len=2, baseline_requests=0)
    held = result["kv_bytes_per_token_at_peak"]
    # the full layer's whole context, and each sliding layer's window and a block or two of 64 tokens
    assert per_layer <= held <= per_layer * (1 + 5 * (8 + 2 * BLOCK) / 64)
    assert result["kv_cache_peak_mib"] == pytest.approx(held * 64 / 2**20, abs=0.01)


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_a_windowed_model_on_cuda_gives_transformers_tokens(tiny_model_factory, family):
    """The GPU's path: SDPA over the blocks a sliding group's window reaches (GPT-OSS's sinks by the matmuls), the
    blocks behind the window given back; transformers' greedy tokens on the CPU."""
    path = tiny_family(tiny_model_factory, family)
    engine = make_engine(path, device="cuda", enable_prefix_caching=False)
    assert engine.runner.device.type == "cuda"
    ids = prompt(40, 0)
    result, most = run(engine, {"a": ids})
    reference = reference_model(path)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert result["a"]["ids"] == out[0, 40:].tolist()
    windows = engine.model_config.kv_group_windows
    assert most <= blocks_for(windows, BLOCK, 40 + 24 - 1, 12)
