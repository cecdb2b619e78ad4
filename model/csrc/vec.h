// What the CPU kernels share: GCC vector extensions (the compiler lowers a 16-float vector to whatever SIMD
// the target has: AVX-512, AVX2, NEON) and conversions to float32, where all their arithmetic happens.
#pragma once

#include <torch/extension.h>

constexpr int VL = 16;  // lanes of a vector
typedef float vfloat __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VL * sizeof(int32_t))));

inline float hsum(vfloat v) {  // a fixed tree, so the same bits every time
  for (int w = VL / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) v[l] += v[l + w];
  return v[0];
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
