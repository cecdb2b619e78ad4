// The CPU kernels' entry points, for the Python module (kernels.cpp) and for each other (layer_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seqs, int64_t block_size, double scale, int64_t window, int64_t chunk,
                              std::optional<torch::Tensor> k, std::optional<torch::Tensor> v,
                              std::optional<torch::Tensor> slots, std::optional<torch::Tensor> cos,
                              std::optional<torch::Tensor> sin);
torch::Tensor silu_mul(torch::Tensor x);
std::vector<torch::Tensor> rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
                                    double eps);
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                      std::optional<torch::Tensor> bias, int64_t N, bool float_out);
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, std::optional<torch::Tensor> bias,
                      int64_t N, bool float_out);
torch::Tensor q4_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins, torch::Tensor ids, int64_t K);
torch::Tensor q8_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor ids, int64_t K);
