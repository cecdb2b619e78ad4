// The CPU kernels' entry points, for the Python module (kernels.cpp) and for each other (layer_stack.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// The tiers whose quantized GEMMs can round activations to int8 (quant_gemm_i8.cpp, QuantGemm.int8): AVX512-VNNI
// with BF16 (bfloat16 ones), not AMX's, whose tier keeps int16; and AVX2 alone (any), not the avx512 tier's
#if (defined(__AVX512VNNI__) && defined(__AVX512BF16__) && !defined(__AMX_INT8__)) || \
    (defined(__AVX2__) && !defined(__AVX512F__))
#define INT8_ACTIVATIONS 1
#endif

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                              at::Tensor seqs, int64_t block_size, double scale, int64_t window, double softcap,
                              int64_t chunk,
                              std::optional<at::Tensor> k, std::optional<at::Tensor> v,
                              std::optional<at::Tensor> slots, std::optional<at::Tensor> cos,
                              std::optional<at::Tensor> sin, std::optional<at::Tensor> sinks,
                              std::optional<at::Tensor> prompt_runs = std::nullopt, bool emulate_tiles = false);
at::Tensor silu_mul(at::Tensor x);
at::Tensor clamped_swiglu(at::Tensor x, double alpha, double limit);
std::vector<at::Tensor> rms_norm(at::Tensor x, std::optional<at::Tensor> residual,
                                 std::optional<at::Tensor> weight, double eps);
struct QuantGemm;
at::Tensor quant_gemm(at::Tensor x, const QuantGemm& gemm, bool float_out);
at::Tensor quant_rows(const QuantGemm& gemm, at::Tensor ids, int64_t K);
// A prompt's rows on AMX's bfloat16 tiles, the weights dequantized to bfloat16 a step at a time (the amx tier
// only: kernels.gemm_dequantized)
at::Tensor quant_gemm_dequantized(at::Tensor x, const QuantGemm& gemm);
// The rows in prompt_runs ([R, 2] int64 runs [start, end)) as quant_gemm_dequantized, the others as quant_gemm
at::Tensor quant_gemm_rows(at::Tensor x, const QuantGemm& gemm, const at::Tensor& prompt_runs);
// Each of T rows: 1 where prompt_runs names it, else 0 (checked); empty without prompt_runs
std::vector<char> prompt_rows(const std::optional<at::Tensor>& prompt_runs, int64_t T);
at::Tensor pack_quant(at::Tensor q, int64_t bits, int64_t group);
at::Tensor uniform_noise(at::Tensor seeds, at::Tensor positions, int64_t vocab_size);
at::Tensor argmax_rows(at::Tensor x);
at::Tensor gated_delta_net(at::Tensor proj, at::Tensor conv_w, at::Tensor A_log, at::Tensor dt_bias,
                           at::Tensor norm_w, at::Tensor conv_state, at::Tensor recurrent_state, at::Tensor seqs,
                           int64_t num_key_heads, int64_t key_head_dim, int64_t value_head_dim, double eps,
                           bool tiled_value_heads);
