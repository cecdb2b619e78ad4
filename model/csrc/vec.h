// What the CPU kernels share: GCC vector extensions of the target's own vector width (16 floats with AVX-512,
// 8 with AVX2, 4 on the baseline: SSE2, NEON) and conversions to float32, where all their arithmetic happens.
// The width must be the target's: a wider vector has no register of its own there, and GCC keeps it on the
// stack, every operation a load and a store (seen: the 16-float quantized GEMM built for AVX2, 41% of whose
// instructions touched the stack, took 781 us for one row of a 1536 x 576 weight; torch's float32 GEMM, 89 us).
#pragma once

// ATen's own headers, not torch/extension.h: the kernels need tensors, dispatch and parallel_for, and the whole
// C++ front end doubled every file's compile time (each tier builds every file again)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#if defined(__AVX512F__)
constexpr int VL = 16;  // lanes of a vector
#elif defined(__AVX__)
constexpr int VL = 8;
#else
constexpr int VL = 4;
#endif
typedef float vfloat __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VL * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(VL * sizeof(uint32_t))));

template <typename V, typename W>
inline V bitcast(W w) {
  static_assert(sizeof(V) == sizeof(W));
  V v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

inline float hsum(vfloat v) {  // a fixed tree, so the same bits every time
  for (int w = VL / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) v[l] += v[l + w];
  return v[0];
}

// Ask for the cache line at p into L2 ahead of its use. Into L1, streams of weights and KV rows kept their loads
// waiting on memory (quant_gemm.h, paged_attention.cpp: measured both ways)
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x): 2^k p(r) with k = round(x / ln2), r = x - k ln2 in [-ln2/2, ln2/2] (ln2 split in two parts so k ln2 is
// exact), p the degree-6 Taylor polynomial (relative error < 2e-7 on that range). x is clamped to [-87, 88]:
// below, ~1e-38 (callers zero what must be exactly 0); above, the largest finite powers of two.
inline vfloat vexp(vfloat x) {
  x = x < -87.0f ? vfloat{} - 87.0f : x;
  x = x > 88.0f ? vfloat{} + 88.0f : x;
  const vfloat k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // adding 1.5 * 2^23 rounds
  const vfloat r = x - k * 0.693145751953125f - k * 1.42860682030941723212e-6f;
  const vfloat p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const vint bits = (__builtin_convertvector(k, vint) + 127) << 23;
  return p * bitcast<vfloat>(bits);
}
