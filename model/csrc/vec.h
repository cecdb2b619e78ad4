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

#include <type_traits>

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

typedef uint16_t vhalfword __attribute__((vector_size(VL * sizeof(uint16_t))));

// VL float32 -> bfloat16 with c10's rounding (to nearest even, NaN to 0x7FC0), so the bits are what
// static_cast<c10::BFloat16> gives, VL at a time
inline vhalfword to_bf16(vfloat v) {
  const vuint u = bitcast<vuint>(v);
  const vuint rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const vuint nan = bitcast<vuint>(v != v);
  return __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vhalfword);
}

// VL values at p as float32 (exact), and VL float32 stored to p rounded as static_cast rounds each one: for
// elementwise kernels, whose loops of c10 casts GCC left a value at a time (activation.cpp's SwiGLU: 2.4x
// faster in float32, 1.1-1.2x in bfloat16, the same bits; measured 2026-11-27)
inline vfloat load_floats(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load_floats(const c10::BFloat16* p) {  // a bfloat16 is the high half of its float32
  vhalfword h;
  __builtin_memcpy(&h, p, sizeof(h));
  return bitcast<vfloat>(__builtin_convertvector(h, vuint) << 16);
}
template <typename T>  // float16 (and the double that ATen's dispatch instantiates): a value at a time
inline vfloat load_floats(const T* p) {
  vfloat v;
  for (int l = 0; l < VL; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
inline void store_floats(vfloat v, float* p) { __builtin_memcpy(p, &v, sizeof(v)); }
inline void store_floats(vfloat v, c10::BFloat16* p) {
  const vhalfword h = to_bf16(v);
  __builtin_memcpy(p, &h, sizeof(h));
}
template <typename T>
inline void store_floats(vfloat v, T* p) {
  for (int l = 0; l < VL; ++l) p[l] = static_cast<T>(v[l]);
}
// v rounded to T and back: what to_float(static_cast<T>(x)) gives each lane
template <typename T>
inline vfloat round_to(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bitcast<vfloat>(__builtin_convertvector(to_bf16(v), vuint) << 16);
  } else {
    for (int l = 0; l < VL; ++l) v[l] = static_cast<float>(static_cast<T>(v[l]));
    return v;
  }
}

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
