"""Decode steps replayed from CUDA graphs, on a GPU.

A decode step of a small batch is a few hundred short kernels; launched one at a time from Python, the GPU waits
on the host between them (a reading of the code predicted 4-8 ms a step against a ~0.06 ms memory floor for the
default model's shape). Captured once for each batch size of BUCKETS at start, a decode step is one replay: its
tokens, positions and attention metadata are copied into the graph's own input tensors and the whole forward runs
as recorded. A step of n decodes replays the smallest bucket of at least n; the rows past n decode a dummy token
at position 0 whose K/V go to a block no request holds (the cache's last, kept back), and are dropped.

Only where every op of a decode step can be recorded: attention by the Triton kernel (it reads its metadata from
tensors on the device, not from shapes), MoE layers only with their experts grouped on the device
(model/moe_triton.py; PyTorch's loop reads expert counts on the host), Gated DeltaNet layers only where a step of
decodes runs all its sequences at once (model/deltanet.py's _decodes: their state slots and positions are inputs
too, and the padded rows' state goes to a slot no request holds, the cache's spare), no LongRoPE. Prefill and
mixed steps, and decode batches past the largest bucket, run eagerly.
"""

import logging
import time

import torch

from model.attention import kernel_tables
from model.attention_triton import TritonAttention, TritonAttentionMetadata
from model.deltanet import DecodeStates
from model.device import to_device
from model.kv_cache import KVCache
from model.moe import DenseAndMoE, MoE
from model.transformer import Transformer

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def why_not_graphed(model: Transformer, attention) -> str | None:
    """Why a decode step of this model cannot be recorded (None: it can)."""
    config = model.config
    if not isinstance(attention, TritonAttention):
        return "attention is not the Triton kernel"
    if any(layer.linear and not layer.attn.parallel for layer in model.layers):
        return "Gated DeltaNet layers that run a step's sequences one by one"
    sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE | DenseAndMoE)]
    if any((mlp.moe if isinstance(mlp, DenseAndMoE) else mlp).grouped is None for mlp in sparse):
        return "MoE layers whose experts run PyTorch's loop (it reads their counts on the host)"
    if config.longrope_original_len is not None:
        return "LongRoPE"
    return None


class DecodeGraphs:
    def __init__(self, model: Transformer, kv_cache: KVCache, attention: TritonAttention, max_batch: int,
                 max_blocks: int, capture: bool = True):  # fmt: skip
        """Input tensors for up to the bucket that holds max_batch decodes, each reading at most max_blocks
        blocks. capture=False runs each step's forward eagerly on those same tensors (a CPU has no graphs: the
        tests check the buffers and padding that way)."""
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        # past the largest bucket (--max-num-seqs above 256), decode steps run eagerly
        self.buckets = sorted(
            {b for b in BUCKETS if b < max_batch}
            | {min(b for b in BUCKETS if b >= min(max_batch, BUCKETS[-1]))}
        )
        self.scratch = kv_cache.num_blocks - 1  # padded rows' K/V go here: the scheduler never hands it out
        self.capture_graphs = capture
        device, B, groups = kv_cache.k.device, self.buckets[-1], max(1, len(model.config.kv_groups))
        self.ids = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.seqs = torch.zeros(B, 3, dtype=torch.int32, device=device)  # [first token, 1, sequence length]
        self.slots = torch.zeros(groups, B, dtype=torch.long, device=device)
        self.tables = torch.zeros(groups, B, max_blocks, dtype=torch.int32, device=device)
        tiles = torch.stack((torch.arange(B), torch.zeros(B, dtype=torch.long)), 1)  # a decode a program
        self.tiles = tiles.to(device=device, dtype=torch.int32)
        # a hybrid's DeltaNet layers: each row's state slot (its tokens before this one are its position)
        self.hybrid = bool(model.config.linear_layers)
        self.state_slots = torch.zeros(B, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replayed = 0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _metas(self, b: int) -> list[TritonAttentionMetadata]:
        a = self.attention
        return [
            TritonAttentionMetadata(
                self.slots[g, :b],
                self.tables[g, :b],
                self.seqs[:b],
                self.tiles[:b],
                a.block_size,
                a.block_m[g],
            )  # fmt: skip
            for g in range(self.slots.shape[0])
        ]

    def _forward(self, b: int) -> torch.Tensor:
        states = DecodeStates(self.state_slots[:b], self.positions[:b]) if self.hybrid else None
        return self.model(self.ids[:b], self.positions[:b], self._metas(b), self.kv_cache, None, states)

    def capture(self) -> None:
        """Records a step of every bucket, largest first (the memory pool they share fits them all), each after
        one eager run (Triton's compile and cuBLAS's choices happen outside the recording)."""
        start = time.monotonic()
        self._fill([], [], [], [], self.buckets[-1])  # every row a dummy in the scratch block
        pool = None
        with torch.inference_mode():  # as the runner's steps run
            for b in reversed(self.buckets):
                self._forward(b)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info(
            "decode steps: CUDA graphs for batches of %s (%.1f s)", self.buckets, time.monotonic() - start
        )

    def run(
        self, ids: list[int], seq_lens: list[int], block_tables: list[list[list[int]]], state_slots: list[int],
        fed_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[n, hidden] after a decode step of n sequences (each's last token: ids[i] at seq_lens[i] - 1; a
        hybrid's DeltaNet state in state_slots[i], else no slots) from the graph of the smallest bucket that
        holds n. fed_ids: (rows, their ids on the device) where the previous step's draws are the inputs."""
        n = len(ids)
        b = self.bucket(n)
        self._fill(ids, seq_lens, block_tables, state_slots, b)
        if fed_ids is not None:
            self.ids.index_copy_(0, *fed_ids)
        if not self.capture_graphs:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        self.replayed += 1
        return self.outputs[b][:n]

    def _fill(
        self, ids: list[int], seq_lens: list[int], block_tables: list[list[list[int]]], state_slots: list[int],
        b: int,
    ) -> None:  # fmt: skip
        """The inputs of a step of len(ids) decodes, padded to b rows, copied into the graphs' tensors: each padded
        row a sequence of one token in the kept-back block (and a hybrid's, its state in the cache's spare slot).
        A table's columns past the step's longest sequence are left as they were: the kernel reads none of them."""
        pad = b - len(ids)
        padded_tables = block_tables + [[[self.scratch]] * self.slots.shape[0]] * pad
        positions, seqs, groups = kernel_tables(
            [1] * b, seq_lens + [1] * pad, padded_tables, self.attention.block_size
        )
        slots = torch.stack([s for s, _ in groups])  # [groups, b]
        tables = torch.stack([t for _, t in groups])  # [groups, b, width]
        device, width = self.ids.device, tables.shape[-1]
        self.ids[:b].copy_(to_device(torch.tensor(ids + [0] * pad), device), non_blocking=True)
        self.positions[:b].copy_(to_device(positions, device), non_blocking=True)
        self.seqs[:b].copy_(to_device(seqs, device), non_blocking=True)
        self.slots[:, :b].copy_(to_device(slots, device), non_blocking=True)
        self.tables[:, :b, :width].copy_(to_device(tables, device), non_blocking=True)
        if self.hybrid:
            padded_slots = torch.tensor(state_slots + [self.kv_cache.spare_state_slot] * pad)
            self.state_slots[:b].copy_(to_device(padded_slots, device), non_blocking=True)
