// GEMMs on quantized weights (CPU): y = x W^T (+ bias), W in groups of 32 weights along K, each group stored as
// small integers q with a float32 scale d (and, 4-bit, a minimum):
//   q4 (GGUF Q4_0, Q4_1, int4 at load): w = d * q + m, q in 0..15
//   q8 (GGUF Q8_0, int8 at load):       w = d * q,     q in -127..127
// A group's sum runs on the exact integers, sum_k x_k q_k in float32, then times d (plus m * sum_k x_k): nothing
// is rounded to a 16-bit weight. Two kernels, by what the CPU multiplies natively (model/cpu_tier.py):
// bfloat16 activations on AVX512-BF16 (quant_gemm_bf16.cpp), float32 activations everywhere
// (quant_gemm_f32.cpp; bfloat16 ones are widened to float32 first where the CPU has no bfloat16 arithmetic).
//
// Layout (model/quant.py packs it): output rows in tiles of 16 (one vector lane each), K in groups of 32:
//   q4: [tiles, groups, 8 chunks, 32 bytes]; chunk c, byte 2j + i holds lane j's q[4c + i] (low nibble) and
//       q[4c + 2 + i] (high nibble)
//   q8: [tiles, groups, 16 chunks, 32 bytes]; chunk c, byte 2j + i holds lane j's q[2c + i]
//   scales (d), mins (m): [tiles, groups, 16] float16 (as GGUF stores them: exact)
// Every row of x runs the same instructions in the same order whatever the batch, so a token's output has the
// same bits alone or in any batch (no padding needed).

#include "quant_gemm.h"

namespace {

at::Tensor gemm(bool q4, at::Tensor x, at::Tensor packed, at::Tensor scales, std::optional<at::Tensor> mins,
                   std::optional<at::Tensor> bias, int64_t N, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be [M, K] bfloat16 or float32");
  const int64_t M = x.size(0), K = x.size(1), groups = K / GROUP, tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(K % GROUP == 0, "K must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.numel() == tiles * groups * group_bytes(q4),
              "packed weights mismatch");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == tiles * groups * TILE, "scales mismatch");
  TORCH_CHECK(!q4 || (mins && mins->numel() == scales.numel()), "mins mismatch");
  at::Tensor b;
  if (bias) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias mismatch");
  }
  packed = packed.contiguous();
  scales = scales.contiguous();
  at::Tensor mins_c = q4 ? mins->contiguous() : at::Tensor();
  const Packed w{q4, K, N, packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                 q4 ? mins_c.data_ptr<at::Half>() : nullptr, b.defined() ? b.data_ptr<float>() : nullptr};
  // float32 out for the logits, else x's own dtype
  const bool out_f32 = float_out || x.scalar_type() == at::kFloat;
  auto out = at::empty({M, N}, x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  const Output o{out_f32 ? out.data_ptr<float>() : nullptr,
                 out_f32 ? nullptr : reinterpret_cast<c10::BFloat16*>(out.data_ptr())};
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    x = x.contiguous();
    gemm_bf16(w, reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), M, o);
    return out;
  }
#endif
  x = x.to(at::kFloat).contiguous();  // exact from bfloat16
#if defined(__AVX2__)
  gemm_i16(w, x.data_ptr<float>(), M, o);
#else
  gemm_f32(w, x.data_ptr<float>(), M, o);
#endif
  return out;
}

}  // namespace

// x [M, K] bfloat16 or float32 -> [M, N] of x's dtype (float32 with float_out): see the layout above
at::Tensor q4_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins,
                      std::optional<at::Tensor> bias, int64_t N, bool float_out) {
  return gemm(true, x, packed, scales, mins, bias, N, float_out);
}

at::Tensor q8_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales, std::optional<at::Tensor> bias,
                      int64_t N, bool float_out) {
  return gemm(false, x, packed, scales, std::nullopt, bias, N, float_out);
}

namespace {

// rows ids of the dequantized weight, float32 [n, K]: the exact values
at::Tensor rows(bool q4, at::Tensor packed, at::Tensor scales, std::optional<at::Tensor> mins,
                   at::Tensor ids, int64_t K) {
  const int64_t groups = K / GROUP, chunk_bytes = group_bytes(q4);
  ids = ids.to(at::kLong).contiguous();
  packed = packed.contiguous();
  scales = scales.contiguous();
  at::Tensor mins_c = q4 ? mins->contiguous() : at::Tensor();
  const int64_t n = ids.numel();
  auto out = at::empty({n, K}, scales.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const at::Half* op = q4 ? mins_c.data_ptr<at::Half>() : nullptr;
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t row = ip[r], t = row / TILE, j = row % TILE;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = wp + (t * groups + g) * chunk_bytes;
        const float d = static_cast<float>(sp[(t * groups + g) * TILE + j]);
        float* o = dst + r * K + g * GROUP;
        if (q4) {
          const float m = static_cast<float>(op[(t * groups + g) * TILE + j]);
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 2; ++i) {
              const uint8_t b = wg[c * 32 + 2 * j + i];
              o[4 * c + i] = static_cast<float>(b & 15) * d + m;  // two roundings, as model/quant.py's
              o[4 * c + 2 + i] = static_cast<float>(b >> 4) * d + m;
            }
        } else {
          for (int c = 0; c < 16; ++c)
            for (int i = 0; i < 2; ++i) o[2 * c + i] = static_cast<int8_t>(wg[c * 32 + 2 * j + i]) * d;
        }
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor q4_rows(at::Tensor packed, at::Tensor scales, at::Tensor mins, at::Tensor ids, int64_t K) {
  return rows(true, packed, scales, mins, ids, K);
}

at::Tensor q8_rows(at::Tensor packed, at::Tensor scales, at::Tensor ids, int64_t K) {
  return rows(false, packed, scales, std::nullopt, ids, K);
}
