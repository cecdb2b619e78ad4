// The decoder layers in one call (layer_stack.cpp): the weights of each layer, held once, at load.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

// One GEMM on quantized weights, as model/quant.py packs them: 4-bit when mins are given, else 8-bit
struct QuantGemm {
  torch::Tensor packed, scales;
  std::optional<torch::Tensor> mins, bias;
  int64_t n;  // output features
  torch::Tensor operator()(const torch::Tensor& x) const;
};

struct Layer {
  torch::Tensor norm1;  // RMSNorm weights before attention and before the MLP
  QuantGemm qkv, o;
  torch::Tensor norm2;
  QuantGemm up, down;  // up: [gate; up] fused
};

struct LayerStack {
  std::vector<Layer> layers;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;  // RMSNorm's epsilon, attention's score scale

  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                     torch::Tensor block_tables, torch::Tensor seqs, int64_t block_size,
                                     int64_t window, int64_t chunk, std::optional<torch::Tensor> cos,
                                     std::optional<torch::Tensor> sin) const;
};
