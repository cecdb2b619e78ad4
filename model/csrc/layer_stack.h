// The decoder layers in one call (layer_stack.cpp): the weights of each layer, held once, at load.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// One run of a weight's rows in one format, as model/quant.py packs it (quant_gemm.cpp, "Layout")
struct QuantSegment {
  at::Tensor packed, scales;  // scales: float16 per group, or int8 sub-scales with supers
  std::optional<at::Tensor> mins, supers, super_mins;
  int64_t bits, group, n;  // n: its output features
};

// One GEMM on quantized weights: its segments' outputs side by side (one segment unless a fused layer's parts
// come in several formats)
struct QuantGemm {
  std::vector<QuantSegment> segments;
  std::optional<at::Tensor> bias;
  int64_t n;  // output features
  at::Tensor operator()(const at::Tensor& x) const;
};

struct Layer {
  at::Tensor norm1;  // RMSNorm weights before attention and before the MLP
  QuantGemm qkv, o;
  at::Tensor norm2;
  QuantGemm up, down;  // up: [gate; up] fused
};

struct LayerStack {
  std::vector<Layer> layers;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;  // RMSNorm's epsilon, attention's score scale

  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                                     at::Tensor block_tables, at::Tensor seqs, int64_t block_size,
                                     int64_t window, int64_t chunk, std::optional<at::Tensor> cos,
                                     std::optional<at::Tensor> sin) const;
};
