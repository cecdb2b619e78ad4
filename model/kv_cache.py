"""The KV cache: one preallocated pool of slots per layer, addressed by slot = block * block_size + offset."""

import torch

from model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, config.num_kv_heads, num_blocks * block_size, config.head_dim)
        # [layers, kv_heads, slots, head_dim]; block b holds slots b*block_size .. (b+1)*block_size-1.
        # Heads outside the slots: one head's block is one contiguous row of block_size * head_dim, so a
        # single gather of rows yields [batch, kv_heads, keys, head_dim], which the attention matmuls take
        # as it is.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._layers = [(self.k[i], self.v[i]) for i in range(config.num_layers)]  # views made once

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem
