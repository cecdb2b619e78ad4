// The quantized GEMMs' shared parts (quant_gemm.cpp has the layout and the entry points): the packed weights of
// one GEMM, float16 scales, the outputs' stores, and the loop over tiles and blocks of rows that each kernel
// (quant_gemm_bf16.cpp, quant_gemm_f32.cpp) runs in.
#pragma once

#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

constexpr int TILE = 16;        // output rows per tile of the packed layout
constexpr int GROUP = 32;       // weights per scale, along K
constexpr int NV = TILE / VL;   // vectors per tile: 1 (AVX-512), 2 (AVX2), 4 (baseline)

// Packed bytes of one group of a tile: 16 lanes x 32 weights, 4 or 8 bits each
constexpr int64_t group_bytes(bool q4) { return q4 ? 256 : 512; }

// VL float16 -> float32
inline vfloat load_halves(const at::Half* p) {
#if defined(__AVX512F__)
  return bitcast<vfloat>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return bitcast<vfloat>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat v;
  for (int l = 0; l < VL; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// One GEMM's weights, as model/quant.py packs them
struct Packed {
  bool q4;
  int64_t K, N;
  const uint8_t* w;       // [tiles, groups, group bytes]
  const at::Half* scale;  // [tiles, groups, 16]
  const at::Half* min;    // [tiles, groups, 16], 4-bit only
  const float* bias;      // [N] or null

  int64_t groups() const { return K / GROUP; }
  int64_t tiles() const { return (N + TILE - 1) / TILE; }
  const uint8_t* tile(int64_t t) const { return w + t * groups() * group_bytes(q4); }
  const at::Half* tile_scale(int64_t t) const { return scale + t * groups() * TILE; }
  const at::Half* tile_min(int64_t t) const { return q4 ? min + t * groups() * TILE : nullptr; }
};

typedef uint16_t vhalfword __attribute__((vector_size(VL * sizeof(uint16_t))));

// VL float32 -> bfloat16 with c10's rounding (to nearest even, NaN to 0x7FC0), so the bits are what
// static_cast<c10::BFloat16> gives, VL at a time
inline vhalfword to_bf16(vfloat v) {
  const vuint u = bitcast<vuint>(v);
  const vuint rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const vuint nan = bitcast<vuint>(v != v);
  return __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vhalfword);
}

// Where a GEMM's outputs go: [M, N] float32 (the logits, float32 models) or bfloat16, one of the two set
struct Output {
  float* f32;
  c10::BFloat16* bf16;

  // the first n of a tile's outputs y (+ bias) into row m at column n0, VL at a time
  void store(int64_t m, int64_t N, int64_t n0, int64_t n, const float* y, const float* bias) const {
    for (int64_t l0 = 0; l0 < n; l0 += VL) {
      const int64_t k = std::min<int64_t>(VL, n - l0);
      vfloat v, b{};
      __builtin_memcpy(&v, y + l0, sizeof(v));
      if (bias) __builtin_memcpy(&b, bias + n0 + l0, k * sizeof(float));
      v += b;
      if (f32) {
        __builtin_memcpy(f32 + m * N + n0 + l0, &v, k * sizeof(float));
      } else {
        const vhalfword h = to_bf16(v);
        __builtin_memcpy(bf16 + m * N + n0 + l0, &h, k * sizeof(uint16_t));
      }
    }
  }
};

// How a kernel cuts one GEMM: blocks of up to `rows` rows of x, `tiles` tiles at once, from the tile's weights
// unpacked once (`unpack`: many rows reuse them) or from the packed bytes
struct Plan {
  int rows, tiles;
  bool unpack;
};

// The loop every kernel runs in: steps of plan.tiles tiles in parallel; in each, the rows of x in blocks of as
// equal a size as can be (9 rows in blocks of 8: 5 + 4, not 8 + 1, whose one chain of products would wait on
// each product's latency). A row's operations depend on neither its block, nor the tiles beside it, nor the
// unpacking, so its bits do not depend on its batch.
//
// A Kernel has plan(M), MAX_ROWS and MAX_TILES (the largest plan), `Unpacked` (a vector type) and UNPACKED
// (vectors per group of an unpacked tile), and:
//   unpack(t, dst)  tile t's weights unpacked, [groups][UNPACKED]
//   rows(R, nt, t, m0, unpacked, next, y)  y[r][i] = output i of tiles t .. t + nt - 1 (i < nt * 16) for row
//       m0 + r, from the unpacked tiles (one after the other) or, null, the packed ones; next: the tiles
//       after, to prefetch
template <class Kernel>
void run_tiles(const Kernel& kernel, const Packed& w, int64_t M, const Output& out) {
  const Plan plan = kernel.plan(M);
  const int64_t steps = (w.tiles() + plan.tiles - 1) / plan.tiles;
  const int64_t per_tile = w.groups() * Kernel::UNPACKED;
  at::parallel_for(0, steps, 1, [&](int64_t s0, int64_t s1) {
    std::vector<typename Kernel::Unpacked> unpacked(plan.unpack ? plan.tiles * per_tile : 0);
    alignas(64) float y[Kernel::MAX_ROWS * Kernel::MAX_TILES * TILE];
    const int64_t blocks = (M + plan.rows - 1) / plan.rows;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t t = s * plan.tiles, nt = std::min<int64_t>(plan.tiles, w.tiles() - t);
      const int64_t n0 = t * TILE, n = std::min<int64_t>(nt * TILE, w.N - n0);
      if (plan.unpack)
        for (int64_t i = 0; i < nt; ++i) kernel.unpack(t + i, unpacked.data() + i * per_tile);
      for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
        const int R = static_cast<int>((M - m0) / (blocks - b));
        const uint8_t* next = b == 0 && s + 1 < s1 ? w.tile(t + nt) : nullptr;  // once a step
        kernel.rows(R, static_cast<int>(nt), t, m0, plan.unpack ? unpacked.data() : nullptr, next, y);
        for (int r = 0; r < R; ++r) out.store(m0 + r, w.N, n0, n, y + r * nt * TILE, w.bias);
        m0 += R;
      }
    }
  });
}

// The kernels, each over x [M, K] (row-major): float32 activations as int16 (AVX2) or as they are (baseline);
// bfloat16 ones as they are where the CPU multiplies them (AVX512-BF16)
#if defined(__AVX2__)
void gemm_i16(const Packed& w, const float* x, int64_t M, const Output& out);
#else
void gemm_f32(const Packed& w, const float* x, int64_t M, const Output& out);
#endif
#if defined(__AVX512BF16__)
void gemm_bf16(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out);
#endif
