"""server/engine/backend.py: what each device's backend decides. The GPU's is decided without touching a GPU (its
choices are made before any tensor reaches the device), so it is checked here on any machine."""

import pytest
import torch

from model.attention import TorchAttention
from model.attention_cpu import CpuKernelAttention
from model.config import ModelConfig
from model.linear import PlainLinear
from model.sampling import TORCH_SAMPLER
from server.engine.backend import CpuBackend, CudaBackend, WeightFormat, select_backend
from server.engine.config import EngineConfig
from server.engine.setup import max_step_drafts
from tests.helpers.tiny_models import tiny_family


@pytest.mark.timeout(60)
def test_a_gpu_backend_runs_pytorch_ops_in_bfloat16_and_never_drafts_under_auto(tiny_llama_dir):
    backend = CudaBackend.create(EngineConfig(), tiny_llama_dir, torch.device("cuda"))
    assert backend.dtype == torch.bfloat16 and backend.weights is WeightFormat.DENSE
    linear = backend.ops.linear
    assert type(linear) is PlainLinear and not linear.batch_invariant  # no padding for invariance on a GPU
    # the norms and SwiGLU as Triton kernels (one launch each, not PyTorch's several); no CPU layer loop
    from model.fused_triton import rms_norm, silu_mul

    assert backend.ops.rms_norm is rms_norm and backend.ops.silu_mul is silu_mul
    assert backend.ops.layer_stack is None and backend.ops.clamped_swiglu is None
    # sparse layers' dense experts as grouped Triton GEMMs (the test environment has Triton; each is checked at load)
    from model.moe_triton import grouped_experts

    assert backend.ops.moe is None and backend.ops.grouped_experts is grouped_experts
    # DeltaNet layers many tokens at once, in PyTorch ops, a step of decodes' recurrence one Triton kernel
    from model.deltanet_triton import deltanet_decodes

    assert backend.ops.parallel_deltanet and backend.ops.gated_delta_net is None
    assert backend.ops.deltanet_decodes is deltanet_decodes
    assert backend.sampler is TORCH_SAMPLER
    assert backend.kv_cache_dtype("auto") == torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 with bfloat16 activations"):
        backend.kv_cache_dtype("float32")
    assert backend.kv_cache_budget(EngineConfig(kv_cache_memory=96 << 20)) == 96 << 20
    # its steps are not batch-invariant, so `auto` speculation drafts nothing (drafts could change the output)
    assert backend.batch_invariant(torch.nn.Linear(2, 2)) is False
    assert max_step_drafts(EngineConfig(), False) == 0
    assert CudaBackend.create(EngineConfig(dtype="float16"), tiny_llama_dir, torch.device("cuda")).dtype == (
        torch.float16
    )


@pytest.mark.timeout(300)
# plain; windows and soft-caps; sinks; groups of two head shapes on a strided cache
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "gemma4"])
def test_a_gpu_backend_serves_the_triton_kernel_where_it_computes_what_pytorch_does(
    tiny_model_factory, family, triton_here, monkeypatch, caplog
):
    """The GPU backend's attention, chosen on this CPU (the kernel under Triton's interpreter, float32): the
    Triton kernel, after a start-time check against the PyTorch path with the model's windows, soft-cap and
    sinks; SDPA over gathered K/V with a warning where the kernel is off or cannot run (on this machine's
    "cuda", which does not exist, it cannot)."""
    import model.attention_triton
    from model.attention_triton import TritonAttention
    from model.transformer import Ops

    config = ModelConfig.from_dir(tiny_family(tiny_model_factory, family))
    cpu = CudaBackend(torch.device("cpu"), torch.float32, Ops(PlainLinear()))
    with caplog.at_level("INFO"):
        assert isinstance(cpu.attention(config, 16, 64), TritonAttention)
    assert "attention: kvserve's Triton kernel" in caplog.text
    fallbacks = [(cpu, "is off by 1 here")]
    if not torch.cuda.is_available():
        cuda = CudaBackend(torch.device("cuda"), torch.bfloat16, Ops(PlainLinear()))
        fallbacks.insert(0, (cuda, "could not run"))
    for backend, why in fallbacks:
        if backend is cpu:
            monkeypatch.setattr(model.attention_triton, "error_against_pytorch", lambda *a, **k: 1.0)
        caplog.clear()
        attention = backend.attention(config, 16, 64)
        assert isinstance(attention, TorchAttention) and attention.sdpa and attention.min_query_len == 1
        assert attention.device == backend.device
        assert (
            f"attention: torch's SDPA over K/V gathered by block table (the Triton kernel {why}"
            in caplog.text
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernels", ["on", "off"])
def test_the_cpu_backend_gives_the_runner_what_it_chose(tiny_llama_dir, kernels):
    """select_backend on the CPU: the tier's kernels or PyTorch ops, and everything the runner takes from it."""
    config = ModelConfig.from_dir(tiny_llama_dir)
    backend = select_backend(
        EngineConfig(device="cpu", cpu_kernels=kernels, dtype="bfloat16"), tiny_llama_dir
    )
    assert isinstance(backend, CpuBackend) and backend.device == torch.device("cpu")
    assert (backend.kernels is not None) == (kernels == "on")
    assert (backend.ops.rms_norm is not None) == (kernels == "on")
    attention = backend.attention(config, 16, 64)
    if kernels == "on":
        assert isinstance(attention, CpuKernelAttention)
        assert backend.sampler.argmax is backend.kernels.argmax_rows
    else:
        assert isinstance(attention, TorchAttention) and not attention.sdpa
        assert backend.sampler is TORCH_SAMPLER
    assert backend.kv_cache_budget(EngineConfig()) == 2 << 30
    assert backend.kv_cache_budget(EngineConfig(kv_cache_memory=1 << 20)) == 1 << 20


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# replayed from a graph, and op by op: a dense model's, a sparse one's (its experts grouped on the device), a
# hybrid's (its DeltaNet decodes together)
@pytest.mark.parametrize(
    "family,eager,overlap",
    [("llama", False, True), ("llama", True, True), ("llama", False, False), ("qwen3moe", True, True),
     ("qwen3_5", False, True), ("qwen3_5", True, True)],
)  # fmt: skip
def test_a_gpu_step_never_blocks_on_the_device(tiny_model_factory, family, eager, overlap):
    """A step's metadata goes to the GPU from pinned memory, the forward and the sampler read nothing back, and the
    draws come back through pinned memory: the step's one wait is on the event recorded after that copy (which
    sync debug mode does not count; any other wait raises), so under async scheduling the host builds the next
    step while the GPU runs this one."""
    from server.engine.engine import Engine
    from server.engine.request import SamplingParams

    engine = Engine(
        str(tiny_family(tiny_model_factory, family)),
        EngineConfig(
            device="cuda",
            kv_cache_memory=64 << 20,
            max_num_seqs=4,
            enforce_eager=eager,
            async_scheduling=overlap,
        ),  # fmt: skip
    )
    for i in range(4):
        engine.add_request(str(i), list(range(3 + i, 40 + i)), SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the prompts
    engine.step()  # a first decode: the pinned host buffers allocated
    outputs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            outputs += engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(len(o.new_token_ids) for o in outputs) == 12


@pytest.mark.timeout(60)
def test_a_gpu_keeps_a_hybrids_state_slot_back_for_its_graphs_padded_rows(tiny_model_factory):
    """Where decode steps may be graphed, a hybrid's cache holds one DeltaNet state slot beyond its running,
    snapshot and draft slots, out of K/V's share of the budget; none on a CPU, under --enforce-eager, or for a
    model without DeltaNet layers."""
    from model.kv_cache import KVCache
    from server.engine.setup import cache_layout

    hybrid = ModelConfig.from_dir(tiny_family(tiny_model_factory, "qwen3_5"))
    dense = ModelConfig.from_dir(tiny_family(tiny_model_factory, "llama"))
    gpu = CudaBackend.create(EngineConfig(), tiny_family(tiny_model_factory, "qwen3_5"), torch.device("cuda"))
    assert gpu.spare_state_slots(hybrid, EngineConfig()) == 1
    assert gpu.spare_state_slots(hybrid, EngineConfig(enforce_eager=True)) == 0
    assert gpu.spare_state_slots(dense, EngineConfig()) == 0
    assert (
        CpuBackend.create(EngineConfig(), tiny_family(tiny_model_factory, "qwen3_5")).spare_state_slots(
            hybrid, EngineConfig()
        )
        == 0
    )
    config = EngineConfig(block_size=16, max_num_seqs=4)
    per_state, per_block = (
        KVCache.bytes_per_state_slot(hybrid),
        KVCache.bytes_per_block(hybrid, 16, torch.float32),
    )
    budget = 64 * per_block + 40 * per_state
    without, with_spare = (cache_layout(hybrid, config, torch.float32, budget, 0, n) for n in (0, 1))
    assert with_spare.num_state_slots == without.num_state_slots
    states = without.num_state_slots + without.num_snapshots + 1
    assert with_spare.num_blocks == (budget - per_state * states) // per_block < without.num_blocks
    cache = KVCache(hybrid, 4, 16, torch.float32, "cpu", 2, 3, 1, num_spare_slots=1)
    assert cache.spare_state_slot == 2 + 3 + 1 and cache.recurrent.shape[1] == 7
