"""model/moe_triton.py, a GPU's sparse layers: the step's (token, expert) pairs sorted by expert on the device and
each layer's experts as two grouped Triton GEMMs, run here under Triton's interpreter against PyTorch's loop over
experts (model/moe.py), for every MoE family's tiny model."""

import pytest
import torch

from model.families import FAMILIES
from model.linear import PlainLinear
from model.loader import load_model
from model.moe import DenseAndMoE, MoE
from model.transformer import Ops
from tests.helpers.tiny_models import ARCHES, ARCHITECTURES, tiny_family

SPARSE = [arch for arch in ARCHES if FAMILIES[ARCHITECTURES[arch]].moe]


def sparse_layers(model) -> list[MoE]:
    mlps = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE | DenseAndMoE)]
    return [mlp.moe if isinstance(mlp, DenseAndMoE) else mlp for mlp in mlps]


@pytest.mark.parametrize("num_experts,top_k,tokens,block_m", [(8, 2, 1, 16), (8, 2, 37, 16), (128, 8, 300, 16),
                                                               (4, 2, 300, 64), (3, 3, 7, 16)])  # fmt: skip
def test_the_plans_tiles_hold_every_pair_once_each_with_its_expert(num_experts, top_k, tokens, block_m):
    """The tiles the grid runs (those below the device's tile count), read as the kernel reads them: every pair
    (token * k + its choice) in exactly one tile, the tile's expert the one the pair chose, and the grid sized on the
    host large enough for any routing."""
    from model.moe_triton import Plan

    g = torch.Generator().manual_seed(tokens)
    scores = torch.rand(tokens, num_experts, generator=g)
    scores[:, 0] += 1  # expert 0 chosen by every token: a long run of one expert's pairs
    ids = scores.topk(top_k, dim=-1).indices
    plan = Plan(ids, num_experts, block_m)
    seen = []
    for tile in range(int(plan.num_tiles)):
        e = int(plan.tile_expert[tile])
        first, count = int(plan.first_pair[e]), int(plan.counts[e])
        rows = [first + (tile - int(plan.first_tile[e])) * block_m + r for r in range(block_m)]
        pairs = [int(plan.order[s]) for s in rows if s < first + count]
        assert pairs, "a tile with no pair"
        assert all(int(ids.flatten()[p]) == e for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(tokens * top_k))
    assert plan.grid_tiles >= int(plan.num_tiles)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", SPARSE)
def test_grouped_experts_sum_what_the_loop_over_experts_sums(tiny_model_factory, arch, triton_here):
    """Each sparse layer's output, float32, grouped against the loop, for a decode's token, a few and a prefill's
    many (tiles of 64 rows once the experts average that many); the experts' weights are views of the stacked copy,
    not a second one."""
    from model.moe_triton import grouped_experts

    path = tiny_family(tiny_model_factory, arch)
    loop, _ = load_model(path, torch.float32, "cpu", Ops(PlainLinear()))
    grouped, _ = load_model(path, torch.float32, "cpu", Ops(PlainLinear(), grouped_experts=grouped_experts))
    for theirs, ours in zip(sparse_layers(loop), sparse_layers(grouped), strict=True):
        assert theirs.grouped is None and ours.grouped is not None
        stacked = ours.grouped.up
        assert all(e.up.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
                   for e in ours.experts)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        for tokens in (1, 5, 64 * len(ours.experts) // ours.top_k):
            x = torch.randn(tokens, stacked.shape[2], generator=g)
            with torch.inference_mode():
                expected, got = theirs(x), ours(x)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_a_kernel_that_is_off_here_leaves_the_loop(tiny_model_factory, triton_here, monkeypatch, caplog):
    """The start check: where the grouped kernel does not compute what the loop does on this device, the layer
    keeps the loop, and the log says why."""
    import model.moe_triton

    monkeypatch.setattr(model.moe_triton, "_works", {})
    monkeypatch.setitem(model.moe_triton.TOLERANCE, torch.float32, -1.0)
    with caplog.at_level("INFO"):
        model_, _ = load_model(tiny_family(tiny_model_factory, "qwen3moe"), torch.float32, "cpu",
                               Ops(PlainLinear(), grouped_experts=model.moe_triton.grouped_experts))  # fmt: skip
    assert all(layer.grouped is None for layer in sparse_layers(model_))
    assert "MoE experts: PyTorch's loop over experts (the grouped kernel is off by" in caplog.text
