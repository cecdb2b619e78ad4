// What the kernel on bfloat16 activations (quant_gemm_bf16.cpp: AVX512-BF16's pair products) reads: a group's
// exact integers as bfloat16 pairs, its scales, and the sums of x per group that a minimum multiplies.
#pragma once

#include "quant_gemm.h"

#if defined(__AVX512BF16__)

namespace bf16_groups {

static_assert(VL == TILE, "one 16-lane vector per tile");

typedef uint16_t vword32 __attribute__((vector_size(64)));

// A format's 16 levels (Packed::levels) as bfloat16 bits in the low 16 of 32 words, for vpermw (exact: whole
// numbers below 128 in magnitude; a float32's top half)
inline __m512i levels_bf16(const int8_t* levels) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels))));
  return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
}

// Chunk c of a group's nibble layout -> two vectors of 16 bfloat16 pairs, 128 + q each: (q[4c], q[4c + 1]),
// (q[4c + 2], q[4c + 3]); with HB high bits (5-, 6-bit q) from the group's high-bit plane (quant_gemm.h)
// (LEVELS: q indexes `table`, levels_bf16's)
template <int HB, int G, bool LEVELS = false>
inline void unpack_nibbles(const uint8_t* group, int c, vuint& low, vuint& high, __m512i table = {}) {
  // lane j: byte 2j | byte 2j+1 << 16. One vpmovzxbw: GCC's own widening of a byte vector took five
  // instructions (two halves, an extract and an insert), and at few rows the unpack competes with the products
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * 32)));
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), bf16_128 = _mm512_set1_epi32(0x43004300);
  if constexpr (HB != 1 && !LEVELS) {  // (w & nibble) | 128.0 in one vpternlogd each (0xEA: a & b | c)
    __m512i lo = _mm512_ternarylogic_epi32(w, nibble, bf16_128, 0xEA);
    __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 4), nibble, bf16_128, 0xEA);
    if constexpr (HB == 2) {
      // 6-bit q (Q6_K): the lane's byte of the high-bit plane holds hi(q[4c]), hi(q[4c + 2]), hi(q[4c + 1]),
      // hi(q[4c + 3]) at bits 0, 2, 4, 6. Times 2^4 + 2^16 (disjoint: the byte shifted by 4 and by 16) puts
      // hi(q[4c]) at bit 4 and hi(q[4c + 1]) at bit 20, and the other two 2 bits above: one vpmulld and a
      // vpternlogd a vector where add_high took eight instructions a chunk. The empty asm hides the constant:
      // GCC made the product two shifts and an add. One row, 2 threads, Zen 4: Q6_K [49152, 2048] 2.69 ->
      // 2.18-2.43 ms, [2048, 6144] 267 -> 233 us (with Q6_K_GROUP's minimum), Q4_K's rate ~1.3x Q6_K's per byte
      const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE;
      const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      __m512i times = _mm512_set1_epi32(0x00010010);
      asm("" : "+v"(times));
      const __m512i t = _mm512_mullo_epi32(h, times), bits = _mm512_set1_epi32(0x00300030);
      lo = _mm512_ternarylogic_epi32(t, bits, lo, 0xEA);
      hi = _mm512_ternarylogic_epi32(_mm512_srli_epi32(t, 2), bits, hi, 0xEA);
    }
    low = bitcast<vuint>(lo);
    high = bitcast<vuint>(hi);
    return;
  }
  low = bitcast<vuint>(w & nibble);
  high = bitcast<vuint>(_mm512_srli_epi32(w, 4) & nibble);
  if constexpr (HB > 0) {
    const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE;
    const vuint h = bitcast<vuint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    add_high<HB>(h >> high_shift(HB, c), low, high);
  }
  if constexpr (LEVELS) {  // q indexes the levels: their bfloat16 bits, one vpermw a vector
    low = bitcast<vuint>(_mm512_permutexvar_epi16(bitcast<__m512i>(low), table));
    high = bitcast<vuint>(_mm512_permutexvar_epi16(bitcast<__m512i>(high), table));
  } else {
    low |= 0x43004300u;
    high |= 0x43004300u;
  }
}

// 32 int8 -> 16 bfloat16 pairs (exact: |q| < 256): each half to 16 float32, then both to bfloat16 in one
// instruction that keeps the bytes' order
inline vuint unpack_q8(const uint8_t* p) {
  const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return bitcast<vuint>(_mm512_cvtne2ps_pbh(high, low));
}

// A group's scale d and offset: m - 128 d (nibble layouts with a minimum: 128 + q), else 0; float32
template <bool WITH_128>
inline void group_scales(const Packed& w, int64_t t, int64_t g, vfloat& d, vfloat& offset) {
  vfloat m;
  w.group_scales(t, g, 0, d, m);
  offset = WITH_128 ? m - 128.0f * d : vfloat{};
}

// the sum of G (32 or 16) bfloat16 in float32, in a fixed order: each pair, then a tree over the pair sums
template <int G>
inline float group_sum(const c10::BFloat16* x) {
  if constexpr (G == 32) {
    vword32 h;
    __builtin_memcpy(&h, x, sizeof(h));
    const vuint w = bitcast<vuint>(h);  // lane j: x[2j] | x[2j + 1] << 16
    return hsum(bitcast<vfloat>(w << 16) + bitcast<vfloat>(w & 0xFFFF0000u));
  } else {
    float pairs[G / 2];
    for (int j = 0; j < G / 2; ++j) pairs[j] = to_float(x[2 * j]) + to_float(x[2 * j + 1]);
    for (int width = G / 4; width > 0; width /= 2)
      for (int j = 0; j < width; ++j) pairs[j] += pairs[j + width];
    return pairs[0];
  }
}

// A group's pair vectors (vector v holds the 16 lanes' weights k = 2v, 2v + 1: 128 + q, the levels, or int8
// q), then its d and offset as float32 vectors: the unpacked form both kernels read, [G / 2 + 2] vectors
template <int BITS, int G, bool MIN>
inline void unpack_group(const Packed& w, int64_t t, int64_t g, vuint* out) {
  constexpr bool NIB = BITS < 8;
  const uint8_t* wg = w.tile(t) + g * (TILE * G * BITS / 8);
  const __m512i table = NIB && !MIN ? levels_bf16(w.levels) : __m512i{};
  for (int c = 0; c < (NIB ? G / 4 : G / 2); ++c) {
    if constexpr (NIB)
      unpack_nibbles<NIB ? BITS - 4 : 0, G, NIB && !MIN>(wg, c, out[2 * c], out[2 * c + 1], table);
    else
      out[c] = unpack_q8(wg + c * 32);
  }
  vfloat d, offset;
  group_scales<MIN>(w, t, g, d, offset);
  out[G / 2] = bitcast<vuint>(d);
  out[G / 2 + 1] = bitcast<vuint>(offset);
}

// Each row's sum over each group of G, [M, K / G]: once per row of x, for every output row
template <int G>
inline std::vector<float> group_sums(const c10::BFloat16* x, int64_t M, int64_t groups) {
  std::vector<float> xsum(M * groups);
  at::parallel_for(0, M * groups, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) xsum[i] = group_sum<G>(x + i * G);
  });
  return xsum;
}

}  // namespace bf16_groups

#endif
