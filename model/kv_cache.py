"""The KV cache: one pool of pages, reserved at start, each holding block_size tokens' K/V of the layers of one KV
group (ModelConfig.kv_groups), addressed by slot = page * block_size + offset; and for a hybrid model's Gated
DeltaNet layers (model/deltanet.py), a pool of per-sequence state slots."""

import math
import mmap

import torch

from model.config import KvGroup, ModelConfig
from model.deltanet import state_width
from model.device import to_device


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros (a key nobody wrote must not be NaN: a masked score's zero weight times it would be). On the CPU,
    anonymous memory that the kernel fills with zeros at each page's first write, so the process holds the
    blocks requests have used, not the whole budget from the start (torch.zeros writes every page). On a GPU
    the pool is allocated whole, as vLLM does."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor keeps the mapping alive; it is unmapped when the last view of the pool goes
    pages = mmap.mmap(-1, nbytes)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_state_slots: int = 1,
        num_snapshot_slots: int = 0,
        num_draft_slots: int = 0,
        num_spare_slots: int = 0,
    ):
        """num_state_slots: sequences a hybrid model's DeltaNet layers can hold state for at once (one each), in
        slots 0 .. num_state_slots - 1; num_snapshot_slots more after them hold copies of states at block
        boundaries, for the prefix cache (server/engine/block_manager.py); num_draft_slots after those, a step's
        states after each token of the decodes that verify drafts (the engine goes back to the last one kept);
        num_spare_slots (0 or 1) after those, one no request holds: a CUDA graph's padded rows write their state
        there (server/engine/decode_graphs.py)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a page holds block_size tokens of every layer of one KV group; all groups' layers share the pool
        self.rows_per_page = config.kv_page_rows
        self.uniform = config.uniform_kv
        if self.uniform:
            # [layers of a page, kv_heads, slots, head_dim]; page b holds slots b*block_size .. (b+1)*block_size-1.
            # Heads outside the slots: one head's block is one contiguous row of block_size * head_dim, so a
            # single gather of rows yields [batch, kv_heads, keys, head_dim], which the attention matmuls take
            # as it is.
            shape = (self.rows_per_page, config.num_kv_heads, num_blocks * block_size, config.head_dim)
        else:
            # Groups whose heads differ (Gemma 4's full layers: 512-wide heads, fewer of them) share the pages, so
            # a page must be the same memory whatever group holds it: slots outside the heads, [rows of a page,
            # slots, the widest layer's KV heads x head_dim], each layer viewing its part of a slot's values as
            # its heads (narrower layers side by side: ModelConfig.kv_groups)
            shape = (self.rows_per_page, num_blocks * block_size, config.kv_width)
        self.k = zeroed_pool(shape, dtype, device)
        self.v = zeroed_pool(shape, dtype, device)
        # layer i's K/V: part `part` of row j of the pages its group g's block tables name
        rows, places, groups = config.kv_rows, config.kv_places, config.kv_groups
        layers = {
            i: (self._row(self.k, groups[g], j, part), self._row(self.v, groups[g], j, part))
            for i, (g, j, part) in places.items()
        }
        self.group_of = [rows[i][0] if i in rows else -1 for i in range(config.num_layers)]  # -1: DeltaNet
        self.num_state_slots = self.num_snapshot_slots = self.num_draft_slots = 0
        self.spare_state_slot = None
        if config.linear_layers:
            spec, n = config.linear_attention, len(config.linear_layers)
            self.num_state_slots, self.num_snapshot_slots = num_state_slots, num_snapshot_slots
            self.num_draft_slots = num_draft_slots
            num_state_slots += num_snapshot_slots + num_draft_slots + num_spare_slots
            if num_spare_slots:
                self.spare_state_slot = num_state_slots - 1
            # the last conv_kernel - 1 convolution inputs and the delta rule's state (each value head's S0 and
            # chunk rows: model/deltanet.py), float32, per sequence
            self.conv = torch.zeros(
                (n, num_state_slots, spec.conv_kernel - 1, spec.conv_dim), dtype=torch.float32, device=device
            )
            width = state_width(spec.key_head_dim, spec.value_head_dim)
            self.recurrent = torch.zeros(
                (n, num_state_slots, spec.num_value_heads, width),
                dtype=torch.float32,
                device=device,
            )
            layers |= {i: (self.conv[j], self.recurrent[j]) for j, i in enumerate(config.linear_layers)}
        self._layers = [layers[i] for i in range(config.num_layers)]  # views made once

    def _row(self, pool: torch.Tensor, group: KvGroup, j: int, part: int) -> torch.Tensor:
        """Part `part` of row j of the pages as a layer of `group` sees it: [kv_heads, slots, head_dim], strided
        where the groups' heads differ (the kernels read its strides)."""
        if self.uniform:
            return pool[j]
        width = group.num_kv_heads * group.head_dim
        values = pool[j][:, part * width : (part + 1) * width]
        return values.unflatten(1, (group.num_kv_heads, group.head_dim)).transpose(0, 1)

    def resident_bytes(self, num_blocks_touched: int) -> int:
        """What the K/V pools hold in memory once blocks 0 .. num_blocks_touched - 1 have been written: on the CPU
        those blocks' pages (zeroed_pool), on a GPU both pools whole."""
        pools = self.k.nbytes + self.v.nbytes
        return pools if self.k.device.type != "cpu" else pools * num_blocks_touched // self.num_blocks

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (K, V) pools, or a DeltaNet layer's (convolution, recurrent) state pools."""
        return self._layers[i]

    @property
    def first_draft_slot(self) -> int:
        return self.num_state_slots + self.num_snapshot_slots

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """State slot src[i] -> dst[i] in every DeltaNet layer: a snapshot taken, or one restored."""
        if src:
            src_index, dst_index = (to_device(torch.tensor(x), self.conv.device) for x in (src, dst))
            self.conv[:, dst_index] = self.conv[:, src_index]
            self.recurrent[:, dst_index] = self.recurrent[:, src_index]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """A page: block_size tokens' K and V in each layer of one KV group."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.kv_page_rows * block_size * config.kv_width * elem

    @staticmethod
    def bytes_per_state_slot(config: ModelConfig) -> int:
        """A sequence's state in the DeltaNet layers (0 for a model without them), float32."""
        spec = config.linear_attention
        if spec is None:
            return 0
        conv = (spec.conv_kernel - 1) * spec.conv_dim
        recurrent = spec.num_value_heads * state_width(spec.key_head_dim, spec.value_head_dim)
        return 4 * len(config.linear_layers) * (conv + recurrent)
