"""model/moe_triton.py, a GPU's sparse layers: the step's (token, expert) pairs sorted by expert on the device and
each layer's experts as two grouped Triton GEMMs, run here under Triton's interpreter against PyTorch's loop over
experts (model/moe.py), for every MoE family's tiny model."""

import pytest
import torch

from model.families import FAMILIES
from model.gguf_blocks import BLOCKS
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
        (stacked,) = ours.grouped.up.runs
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


def quantized_experts(type_names: list[str], num_experts: int, N: int, K: int):
    """Random experts' weights of the formats (a fused layer's runs of rows, one per format) as the GPU keeps them,
    stacked over the experts (DeviceSegment.stack), and each expert's dequantized weight [N * runs, K], float64."""
    from model.linear_triton import DeviceSegment
    from tests.model.test_linear_triton import weight

    runs, dense = [], []
    for r, type_name in enumerate(type_names):
        made = [weight(type_name, N, K, seed=100 * r + e) for e in range(num_experts)]
        segments = [DeviceSegment.create(qt, torch.device("cpu")) for qt, _ in made]
        run = DeviceSegment.stack(segments)
        # each expert's segment now views its slice of the stack: one copy
        assert all(s.quantized.q.data_ptr() == run.quantized.q[e].data_ptr() for e, s in enumerate(segments))
        runs.append(run)
        dense.append(torch.stack([w for _, w in made]))
    return runs, torch.cat(dense, dim=1)


def looped_products(x, dense, bias, ids, pairs_per_row):
    """[pairs, N] float64: each pair's row of x times its expert's weight, plus its bias."""
    experts = ids.flatten()
    rows = x.double()[torch.arange(len(experts)) // pairs_per_row]
    y = torch.einsum("pk,pnk->pn", rows, dense[experts])
    return y if bias is None else y + bias.double()[experts]


@pytest.mark.parametrize("type_name", sorted(BLOCKS))
def test_quantized_experts_of_every_gguf_format_multiply_as_their_dequantized_weights(type_name, triton_here):
    """A GGUF's experts kept quantized on the GPU (model/linear_triton.py's formats, tile by tile): each (token,
    expert) pair's product equals its expert's dequantized weight's, for a decode's pairs and a prefill's; N not a
    multiple of a tile, K two super-blocks."""
    from model.moe_triton import Plan, Projection, grouped_gemm

    E, k = 4, 2
    (run,), dense = quantized_experts([type_name], E, 40, 512)
    g = torch.Generator().manual_seed(0)
    for tokens in (1, 37):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
        x = torch.randn(tokens, 512, generator=g)
        got = grouped_gemm(x, Projection([run], None), Plan(ids, E, 16), k, torch.float32)
        want = looped_products(x, dense, None, ids, k)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_fused_projection_of_two_formats_with_biases_and_pair_scales(triton_here):
    """An expert's gate | up in two formats (two runs, each writing its columns) with biases, read per pair (the
    down projection's rows are pairs: 1 pair a row), each pair's output scaled by its routing weight."""
    from model.moe_triton import Plan, Projection, grouped_gemm

    E, k, tokens = 8, 3, 21
    runs, dense = quantized_experts(["Q4_K", "Q6_K"], E, 24, 256)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(E, 48, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    pairs = torch.randn(tokens * k, 256, generator=g)
    scale = torch.rand(tokens * k, generator=g)
    got = grouped_gemm(pairs, Projection(runs, bias), Plan(ids, E, 16), 1, torch.float32, scale)
    want = looped_products(pairs, dense, bias, ids, 1) * scale.double()[:, None]
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
