// The quantized GEMM for float32 activations on CPUs with AVX2 (the avx2, avx512 and amx tiers, and float32 models
// on the avx512bf16 one; on the amx tier, GEMMs of many rows go on to AMX's int8 tiles: quant_gemm_amx.cpp).
//
// Each group of 32 activations of a row is rounded to int16 against its largest magnitude a: x_k ~ s xq_k with
// s = a / 32767, |xq_k| <= 32767, an error of at most s / 2 (15 bits below the group's largest value; bfloat16
// keeps 8 below each value). The rest is exact: vpmaddwd multiplies int16 pairs and sums each pair into int32 (16
// products an instruction, 1.6 a cycle on Zen 3 against 2 float32 multiply-adds of 8), and a group's 32 products
// of a lane sum into int32 without rounding (|xq q| <= 32767 * 128: 32 of them stay below 2^31). So the sum of a
// group is the same whatever the order of its additions, and the float32 work is per group only, in a fixed
// order: y += d (s sum_k xq_k q_k), then + m (s sum_k xq_k) (with a minimum). Weights are the file's integers as
// they are, and a row's result is its rounded activations times them. On the amx tier, x is rounded to fewer
// levels for 4- and 5-bit weights with a minimum (2047, 1023: amx_activation_limit), so that a group is one
// product on its int8 tiles; its few rows here take the same xq, so the same bits.
//
// The packed layout (quant_gemm.cpp), read 8 lanes at a time: 16 bytes of a chunk widened to 16-bit words give
// each lane the int16 pairs (q[4c], q[4c+1]) and, from the high nibbles, (q[4c+2], q[4c+3]) (4-bit), or
// (q[2c], q[2c+1]) (8-bit): pair p of a group is k = 2p, 2p + 1 either way, against x's pair (xq[2p], xq[2p+1]).

#include "quant_gemm.h"

#if defined(__AVX2__)

#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int HALVES = TILE / 8;  // 8-lane vectors per tile
typedef int32_t v8i __attribute__((vector_size(32)));
// Rows of x computed together from unpacked tiles: 2 accumulators a row, 2 weight vectors and x's broadcast: 15
// of 16 registers
constexpr int BLOCK_ROWS = 6;
// Up to PACKED_ROWS rows, from the packed weights, in blocks of up to PACKED_BLOCK rows
#if defined(__AVX512F__)
constexpr int PACKED_ROWS = 4, PACKED_BLOCK = BLOCK_ROWS;  // 32 registers (measured: 5 and 6 unpack faster)
#else
// 16 registers: a block of 5 or 6 rows spills, and unpacking costs more than it saves below ~12 rows (Zen 3,
// the default model's GEMMs, 2 threads: 5 rows 10.1-10.4 -> 8.4-8.6 ms, 6 rows 11.3 -> 9.4-9.5, 8 rows
// 13.4-14.1 -> 12.1-12.4; 12 rows the same either way, 16 and 32 unpacked faster). A lone stream's verify of
// its drafts runs at these sizes.
constexpr int PACKED_ROWS = 8, PACKED_BLOCK = 4;
#endif

// A tile's q pairs of chunk c, lanes 8h .. 8h + 7: 4-bit, pairs 2c (a) and 2c + 1 (b); 8-bit, pair c (a)
inline void pairs4(const uint8_t* chunk, int h, __m256i& a, __m256i& b) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16 * h)));
  const __m256i nibble = _mm256_set1_epi16(15);
  a = _mm256_and_si256(w, nibble);
  b = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
}
// 5- and 6-bit q: pairs4 with the HB high bits from the group's high-bit plane (quant_gemm.h)
template <int HB, int G>
inline void pairs_high(const uint8_t* group, int c, int h, __m256i& a, __m256i& b) {
  typedef uint32_t v8u __attribute__((vector_size(32)));
  pairs4(group + c * 32, h, a, b);
  const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE + 8 * h;
  const v8u hb = bitcast<v8u>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row))));
  v8u low = bitcast<v8u>(a), high = bitcast<v8u>(b);
  add_high<HB>(hb >> high_shift(HB, c), low, high);
  a = bitcast<__m256i>(low);
  b = bitcast<__m256i>(high);
}
// 4-bit q without a minimum: pairs4 of levels[q], int16, by one byte shuffle (each word's low byte
// indexes the table) and a sign extension of the low bytes
inline void pairs_levels(const uint8_t* chunk, int h, const int8_t* levels, __m256i& a, __m256i& b) {
  pairs4(chunk, h, a, b);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels)));
  a = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(table, a), 8), 8);
  b = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_shuffle_epi8(table, b), 8), 8);
}
inline __m256i pairs8(const uint8_t* chunk, int h) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16 * h)));
}

#if !defined(__AVX512F__)
// The same from the avx2 tier's paired chunks (quant_gemm.h), whose lanes hold q[4c .. 4c + 3] a byte each: one
// byte shuffle makes each pair's 16-bit words; IQ4's levels looked up first and put in the words' high bytes,
// whose arithmetic shift by 8 extends their sign
template <int HB, int G, bool LEVELS>
inline void paired_pairs(const uint8_t* group, int c, int h, const int8_t* levels, __m256i& a, __m256i& b) {
  const __m256i q = chunk_quads<HB, G>(group, c, h);
  constexpr char Z = -1;  // a zero byte
  if constexpr (LEVELS) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels)));
    const __m256i l = _mm256_shuffle_epi8(table, q);
    const __m256i first = _mm256_setr_epi8(Z, 0, Z, 1, Z, 4, Z, 5, Z, 8, Z, 9, Z, 12, Z, 13,  //
                                           Z, 0, Z, 1, Z, 4, Z, 5, Z, 8, Z, 9, Z, 12, Z, 13);
    const __m256i second = _mm256_setr_epi8(Z, 2, Z, 3, Z, 6, Z, 7, Z, 10, Z, 11, Z, 14, Z, 15,  //
                                            Z, 2, Z, 3, Z, 6, Z, 7, Z, 10, Z, 11, Z, 14, Z, 15);
    a = _mm256_srai_epi16(_mm256_shuffle_epi8(l, first), 8);
    b = _mm256_srai_epi16(_mm256_shuffle_epi8(l, second), 8);
    return;
  }
  const __m256i first = _mm256_setr_epi8(0, Z, 1, Z, 4, Z, 5, Z, 8, Z, 9, Z, 12, Z, 13, Z,  //
                                         0, Z, 1, Z, 4, Z, 5, Z, 8, Z, 9, Z, 12, Z, 13, Z);
  const __m256i second = _mm256_setr_epi8(2, Z, 3, Z, 6, Z, 7, Z, 10, Z, 11, Z, 14, Z, 15, Z,  //
                                          2, Z, 3, Z, 6, Z, 7, Z, 10, Z, 11, Z, 14, Z, 15, Z);
  a = _mm256_shuffle_epi8(q, first);
  b = _mm256_shuffle_epi8(q, second);
}
#endif

// x's pair (xq[2p], xq[2p + 1]) in every lane
inline __m256i broadcast_pair(const int16_t* pair) {
  int32_t v;
  std::memcpy(&v, pair, sizeof(v));
  return _mm256_set1_epi32(v);
}

// acc + the lane's two products. The empty asm keeps each accumulator one chain of additions: integer sums
// reassociate freely, and GCC, given the freedom, computed a whole group's products first and kept them on the
// stack (measured: the many-row loop at 0.7 products-instructions a cycle instead of 1.4).
inline __m256i dot_pairs(__m256i acc, __m256i q, __m256i x) {
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(q, x));
  asm("" : "+x"(acc));
  return acc;
}

#if defined(__AVX512F__)
// The same, 16 lanes at once (the avx512 and amx tiers' packed rows: half the instructions of two 8-lane
// halves, for the same integers): a tile's q pairs of chunk c (pairs4), with high bits (pairs_high), IQ4's
// levels (pairs_levels), 8-bit (pairs8)
inline void pairs4_wide(const uint8_t* chunk, __m512i& a, __m512i& b) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
  const __m512i nibble = _mm512_set1_epi16(15);
  a = _mm512_and_si512(w, nibble);
  b = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
}
template <int HB, int G>
inline void pairs_high_wide(const uint8_t* group, int c, __m512i& a, __m512i& b) {
  pairs4_wide(group + c * 32, a, b);
  const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE;
  const vuint hb = bitcast<vuint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
  vuint low = bitcast<vuint>(a), high = bitcast<vuint>(b);
  add_high<HB>(hb >> high_shift(HB, c), low, high);
  a = bitcast<__m512i>(low);
  b = bitcast<__m512i>(high);
}
inline void pairs_levels_wide(const uint8_t* chunk, const int8_t* levels, __m512i& a, __m512i& b) {
  pairs4_wide(chunk, a, b);
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels)));
  a = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_shuffle_epi8(table, a), 8), 8);
  b = _mm512_srai_epi16(_mm512_slli_epi16(_mm512_shuffle_epi8(table, b), 8), 8);
}
inline __m512i pairs8_wide(const uint8_t* chunk) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
}
inline __m512i broadcast_pair_wide(const int16_t* pair) {
  int32_t v;
  std::memcpy(&v, pair, sizeof(v));
  return _mm512_set1_epi32(v);
}
// acc + the lane's two products: one instruction with AVX512-VNNI (the amx tier's), whose sums are vpmaddwd's
// and vpaddd's exactly (no saturation: vpdpwssd, not vpdpwssds)
inline __m512i dot_pairs_wide(__m512i acc, __m512i q, __m512i x) {
#if defined(__AVX512VNNI__)
  acc = _mm512_dpwssd_epi32(acc, q, x);
#else
  acc = _mm512_add_epi32(acc, _mm512_madd_epi16(q, x));
#endif
  asm("" : "+v"(acc));
  return acc;
}
#endif

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float hadd(__m256 v) {  // a fixed tree
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// One row's group of 32 activations rounded to int16 (to nearest, ties to even), with its step s and its own sum.
// A group holding an infinity or a NaN gets s = NaN, so that its outputs are NaN as float32 arithmetic's would be.
inline void quantize_group(const float* x, float limit, int16_t* q, float& step, float& sum) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  sum = hadd(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  const float a = hmax(amax);
  if (!(a <= 3.0e38f) || std::isnan(sum)) {  // an infinity or a NaN somewhere
    step = NAN;
    std::memset(q, 0, GROUP * sizeof(int16_t));
    return;
  }
  step = a / limit;
  const GroupRounding rounding = group_rounding(a, limit);
  const __m256 up = _mm256_set1_ps(rounding.up), scale = _mm256_set1_ps(rounding.scale);
  for (int i = 0; i < 4; i += 2) {
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i], up), scale));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i + 1], up), scale));
    // packs interleaves 128-bit halves: put them back in order; saturation clips a rounding up past 32767
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), packed);
  }
}

// BITS 4 to 6: the nibble layouts, with a minimum; 8: bytes, without (quant_gemm.h's dispatch); groups of G.
// x's steps are per 32 whatever G: a group of 16 takes its half's.
// FORM: the scales' ScaleForm (quant_gemm.h); a super-block's scales are read once for its groups
template <int BITS, int G, bool MIN, int FORM>
struct I16Kernel {
  static constexpr bool Q4 = BITS < 8;  // the nibble layouts: 2 pairs per chunk
  static constexpr int HB = Q4 ? BITS - 4 : 0;
  static constexpr int PAIRS = G / 2;  // k pairs per group
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  static void nibble_pairs(const uint8_t* group, int c, int h, const int8_t* levels, __m256i& a, __m256i& b) {
#if !defined(__AVX512F__)
    if constexpr (PAIRED_CHUNKS) {
      paired_pairs<HB, G, !MIN>(group, c, h, levels, a, b);
      return;
    }
#endif
    if constexpr (HB > 0)
      pairs_high<HB, G>(group, c, h, a, b);
    else if constexpr (!MIN)
      pairs_levels(group + c * 32, h, levels, a, b);
    else
      pairs4(group + c * 32, h, a, b);
  }

  // Blocks of rows from the packed weights up to PACKED_ROWS rows. Past that, the tiles are unpacked
  // once and each block of rows runs over several of them, so that its rows of x stay in L1 while they are
  // reused: as many tiles as fit in ~256 KB of L2 unpacked, and few enough that every thread gets 4 steps
  // (measured: one tile at a time, the rows of x came from L3 for every tile, and the 512-row GEMMs ran at
  // half the speed of their inner loop alone).
  Plan plan(int64_t M) const {
    if (M <= PACKED_ROWS) return {PACKED_BLOCK, 1, false};
    const int64_t fit = (256 << 10) / (w.groups() * UNPACKED * sizeof(__m256i));
    const int64_t spread = (w.tiles() + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
    return {BLOCK_ROWS, static_cast<int>(std::clamp<int64_t>(std::min(fit, spread), 1, MAX_TILES)), true};
  }
  static constexpr int MAX_ROWS = BLOCK_ROWS, MAX_TILES = 8;
  using Unpacked = __m256i;
  // per group: the q pairs ([16 pairs][2 halves]), then d and m as float32 ([2] each)
  static constexpr int UNPACKED = (PAIRS + 2) * HALVES;

  const Packed& w;
  const int16_t* xq;   // [M, K] the activations as int16
  const float* step;   // [M, K / 32] s of each row's 32
  const float* xsum;   // [M, K / G] s sum_k xq_k of each row's group (with a minimum)

  // d and m of lanes 8h .. 8h + 7 (Packed's own reads VL lanes: 16 on the avx512 tier, 8 on avx2)
  void group_scales(int64_t t, int64_t g, int h, __m256& d, __m256& m) const {
    vfloat dv, mv;
    w.group_scales(t, g, h / (VL / 8), dv, mv);
    d = half_lanes(dv, h);
    m = half_lanes(mv, h);
  }
  static __m256 sub_scales(const int8_t* p) {  // 8 int8 -> float32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m256 half_lanes(vfloat v, int h) {
#if defined(__AVX512F__)
    const __m512 wide = bitcast<__m512>(v);
    return h % 2 ? _mm512_extractf32x8_ps(wide, 1) : _mm512_castps512_ps256(wide);
#else
    (void)h;
    return bitcast<__m256>(v);
#endif
  }

  void unpack(int64_t t, __m256i* out) const {
    const uint8_t* wt = w.tile(t);
    for (int64_t g = 0; g < w.groups(); ++g) {
      __m256i* o = out + g * UNPACKED;
      const uint8_t* wg = wt + g * GROUP_BYTES;
      for (int h = 0; h < HALVES; ++h) {
        for (int c = 0; c < (Q4 ? G / 4 : PAIRS); ++c) {
          if constexpr (Q4)
            nibble_pairs(wg, c, h, w.levels, o[(2 * c) * HALVES + h], o[(2 * c + 1) * HALVES + h]);
          else
            o[c * HALVES + h] = pairs8(wg + c * 32, h);
        }
        __m256 d, m;
        group_scales(t, g, h, d, m);
        o[PAIRS * HALVES + h] = bitcast<__m256i>(d);
        o[(PAIRS + 1) * HALVES + h] = bitcast<__m256i>(m);
      }
    }
  }

  // y[r * stride + i]: output i of tile t for row m0 + r
  template <int R, bool UNPACKED_TILE>
  void rows(int64_t t, int64_t m0, const __m256i* unpacked, const uint8_t* next, float* y, int stride) const {
    const int64_t groups = w.groups(), K = w.K;
    const uint8_t* wt = w.tile(t);
    __m256 out[R][HALVES];
    __m256 super_d[HALVES], super_m[HALVES];  // the current super-block's (FORM INT8_SUBS, SIX_BIT_SUBS)
    v8i high[HALVES];  // the current super-block's high bits (SIX_BIT_SUBS)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HALVES; ++h) out[r][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (next)  // the next tile's bytes, asked for ahead: see quant_gemm_bf16.cpp
        for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + g * GROUP_BYTES + i);
      __m256i acc[R][HALVES];
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < HALVES; ++h) acc[r][h] = _mm256_setzero_si256();
      const int16_t* x = xq + m0 * K + g * G;
      __m256 d[HALVES], m[HALVES];
      if constexpr (UNPACKED_TILE) {
        const __m256i* u = unpacked + g * UNPACKED;
#pragma GCC unroll 16
        for (int p = 0; p < PAIRS; ++p) {
          const __m256i q0 = u[p * HALVES], q1 = u[p * HALVES + 1];
          for (int r = 0; r < R; ++r) {
            const __m256i xp = broadcast_pair(x + r * K + 2 * p);
            acc[r][0] = dot_pairs(acc[r][0], q0, xp);
            acc[r][1] = dot_pairs(acc[r][1], q1, xp);
          }
        }
        for (int h = 0; h < HALVES; ++h) {
          d[h] = _mm256_castsi256_ps(u[PAIRS * HALVES + h]);
          m[h] = _mm256_castsi256_ps(u[(PAIRS + 1) * HALVES + h]);
        }
      } else {
        const uint8_t* wg = wt + g * GROUP_BYTES;
#pragma GCC unroll 16
        for (int c = 0; c < (Q4 ? G / 4 : PAIRS); ++c)
          for (int h = 0; h < HALVES; ++h) {
            if constexpr (Q4) {
              __m256i a, b;
              nibble_pairs(wg, c, h, w.levels, a, b);
              for (int r = 0; r < R; ++r) {
                acc[r][h] = dot_pairs(acc[r][h], a, broadcast_pair(x + r * K + 4 * c));
                acc[r][h] = dot_pairs(acc[r][h], b, broadcast_pair(x + r * K + 4 * c + 2));
              }
            } else {
              const __m256i a = pairs8(wg + c * 32, h);
              for (int r = 0; r < R; ++r) acc[r][h] = dot_pairs(acc[r][h], a, broadcast_pair(x + r * K + 2 * c));
            }
          }
        for (int h = 0; h < HALVES; ++h) {
          if constexpr (FORM != HALF_SCALES) {  // Packed::group_scales' products, the super-block's read once
            if (g % (SUPER / G) == 0) {
              const int64_t at = (t * w.supers() + g / (SUPER / G)) * TILE + 8 * h;
              super_d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.super_d + at)));
              if constexpr (MIN)
                super_m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.super_m + at)));
              if constexpr (FORM == SIX_BIT_SUBS) __builtin_memcpy(&high[h], w.sub_high + at, sizeof(high[h]));
            }
            const int64_t at = (t * groups + g) * TILE + 8 * h;
            if constexpr (FORM == SIX_BIT_SUBS) {
              const auto* low = reinterpret_cast<const __m128i*>(w.sub + at);
              v8i sc, sm;
              six_bit_subs(bitcast<v8i>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(low))), high[h] >> (2 * (g % (SUPER / G))), sc, sm);
              d[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(bitcast<__m256i>(sc)), super_d[h]);
              m[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(bitcast<__m256i>(sm)), super_m[h]);
            } else {
              d[h] = _mm256_mul_ps(sub_scales(w.sub + at), super_d[h]);
              m[h] = MIN ? _mm256_mul_ps(sub_scales(w.sub_min + at), super_m[h]) : _mm256_setzero_ps();
            }
          } else {
            group_scales(t, g, h, d[h], m[h]);
          }
        }
      }
      // y += d (s sum) (+ m s sum_k xq_k): per group, in this order, for every row alike
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_set1_ps(step[(m0 + r) * (K / GROUP) + g * G / GROUP]);
        for (int h = 0; h < HALVES; ++h) {
          const __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), s);
          out[r][h] = _mm256_fmadd_ps(sum, d[h], out[r][h]);
          if constexpr (MIN)
            out[r][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(xsum[(m0 + r) * groups + g]), out[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HALVES; ++h) _mm256_storeu_ps(y + r * stride + 8 * h, out[r][h]);
  }

#if defined(__AVX512F__)
  // rows<R, false> with the tile's 16 lanes in one vector: the same operations on each lane, so the same bits
  // (measured on the amx Xeon, the 12 sparse FFNs of the Qwen3-30B-A3B cut at one token, cold, alternated with
  // the build before, of 8-lane halves and 8-bit sub-scales: 30.7-33.1 -> 26.3-29.2 ms)
  template <int R>
  void rows_wide(int64_t t, int64_t m0, const uint8_t* next, float* y, int stride) const {
    const int64_t groups = w.groups(), K = w.K;
    const uint8_t* wt = w.tile(t);
    __m512 out[R];
    [[maybe_unused]] SuperScales<FORM, MIN, G> supers;
    for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (next)
        for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + g * GROUP_BYTES + i);
      __m512i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      const int16_t* x = xq + m0 * K + g * G;
      const uint8_t* wg = wt + g * GROUP_BYTES;
#pragma GCC unroll 16
      for (int c = 0; c < (Q4 ? G / 4 : PAIRS); ++c) {
        if constexpr (Q4) {
          __m512i a, b;
          if constexpr (HB > 0)
            pairs_high_wide<HB, G>(wg, c, a, b);
          else if constexpr (!MIN)
            pairs_levels_wide(wg + c * 32, w.levels, a, b);
          else
            pairs4_wide(wg + c * 32, a, b);
          for (int r = 0; r < R; ++r) {
            acc[r] = dot_pairs_wide(acc[r], a, broadcast_pair_wide(x + r * K + 4 * c));
            acc[r] = dot_pairs_wide(acc[r], b, broadcast_pair_wide(x + r * K + 4 * c + 2));
          }
        } else {
          const __m512i a = pairs8_wide(wg + c * 32);
          for (int r = 0; r < R; ++r) acc[r] = dot_pairs_wide(acc[r], a, broadcast_pair_wide(x + r * K + 2 * c));
        }
      }
      vfloat d, m;
      if constexpr (FORM != HALF_SCALES)
        supers.group(w, t, g, 0, d, m);
      else
        w.group_scales(t, g, 0, d, m);
      // y += d (s sum) (+ m s sum_k xq_k), as rows<R, false>
      for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(step[(m0 + r) * (K / GROUP) + g * G / GROUP]));
        out[r] = _mm512_fmadd_ps(sum, bitcast<__m512>(d), out[r]);
        if constexpr (MIN)
          out[r] = _mm512_fmadd_ps(bitcast<__m512>(m), _mm512_set1_ps(xsum[(m0 + r) * groups + g]), out[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * stride, out[r]);
  }
#endif

  // nt tiles: unpacked, one after the other (the plan's); packed, one (the plan's for a block of rows). next:
  // the next step's nt tiles, tile i's asked for while tile i runs (measured: with only the first of them asked
  // for, Q8_0's [49152, 576] LM head, whose bytes come from memory, ran 6 rows in 2.4x the time of 4)
  void rows(int R, int nt, int64_t t, int64_t m0, const __m256i* unpacked, const uint8_t* next, float* y) const {
    for (int i = 0; i < nt; ++i) {
      const __m256i* u = unpacked ? unpacked + i * w.groups() * UNPACKED : nullptr;
      const uint8_t* next_i = next && t + nt + i < w.tiles() ? next + i * w.groups() * GROUP_BYTES : nullptr;
#if defined(__AVX512F__)
#define FROM_PACKED(n) rows_wide<n>(t + i, m0, next_i, y + i * TILE, nt * TILE)
#else
#define FROM_PACKED(n) rows<n, false>(t + i, m0, nullptr, next_i, y + i * TILE, nt * TILE)
#endif
#define FROM_UNPACKED(n) rows<n, true>(t + i, m0, u, next_i, y + i * TILE, nt * TILE)
      // Only the block sizes plan() makes are compiled, each a fully unrolled loop (all six of both kinds: 92 s
      // of this file's compile, 62 s these): the packed weights' M <= PACKED_ROWS rows in blocks of at most 4;
      // more rows from the unpacked ones, in blocks of up to 6 as equal as can be, never fewer than 3 (7: 3 + 4)
      static_assert(std::min(PACKED_ROWS, PACKED_BLOCK) <= 4 && PACKED_ROWS >= 2 && BLOCK_ROWS == 6);
      if (u && R == 3) FROM_UNPACKED(3);
      else if (u && R == 4) FROM_UNPACKED(4);
      else if (u && R == 5) FROM_UNPACKED(5);
      else if (u && R == 6) FROM_UNPACKED(6);
      else if (!u && R == 1) FROM_PACKED(1);
      else if (!u && R == 2) FROM_PACKED(2);
      else if (!u && R == 3) FROM_PACKED(3);
      else if (!u && R == 4) FROM_PACKED(4);
      else TORCH_CHECK(false, "quant_gemm: no ", u ? "unpacked" : "packed", " kernel for blocks of ", R, " rows");
#undef FROM_UNPACKED
#undef FROM_PACKED
    }
  }
};

}  // namespace

#if defined(__AMX_INT8__)
// Up to this many rows on vectors, past it on AMX's tiles (the same bits): a tile's products pay for 16 rows
// whatever it holds. Measured, an MoE expert's [1536, 2048] Q4_K and [2048, 768] Q6_K, 2 threads: vectors ~2x
// faster at 1 to 3 rows, even at 4, tiles faster from 6.
constexpr int64_t VECTOR_ROWS = 4;
#endif

void gemm_i16(const Packed& w, const float* x, int64_t M, const Output& out) {
  const int64_t groups = w.K / GROUP, K = w.K;
#if defined(__AMX_INT8__)
  const int64_t padded = (M + TILE - 1) / TILE * TILE;  // the tiles scale whole blocks of 16 rows: 0 past M
  const float limit = amx_activation_limit(w.bits, w.has_min);  // that the tiles' bytes hold: quant_gemm_amx.cpp
#else
  const int64_t padded = M;
  const float limit = 32767.0f;
#endif
  std::vector<int16_t> xq(M * K);
  std::vector<float> step(padded * groups), xsum(M * groups);  // xsum: where quantize_group finds infinities, NaNs
  at::parallel_for(0, M * groups, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_group(x + i * GROUP, limit, xq.data() + i * GROUP, step[i], xsum[i]);
  });
  dispatch(w, [&](auto bits, auto g, auto min) {
    constexpr int G = g();
    // The minimum's term per group: s sum_k xq_k, the rounded activations' own sum (exact in int32, then one
    // rounding), so that a row's result is its rounded x times the exact weights, minimum included. With x's
    // float32 sum instead, the rounding's error came back weighted by q (up to 63) rather than by w (measured:
    // a tiny Q6_K / Q5_0 model's scores 7x further from float32's).
    std::vector<float> sums(min() ? padded * K / G : 0);
    if constexpr (min())
      at::parallel_for(0, M * K / G, 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          int32_t total = 0;
          for (int k = 0; k < G; ++k) total += xq[i * G + k];
          sums[i] = step[i * G / GROUP] * static_cast<float>(total);
        }
      });
#if defined(__AMX_INT8__)
    if (M > VECTOR_ROWS) return gemm_amx(w, xq.data(), step.data(), sums.data(), M, out);
#endif
    dispatch_scales(w, [&](auto form) {
      if constexpr (form_of(form(), bits(), G, min()))
        run_tiles(I16Kernel<bits(), G, min(), form()>{w, xq.data(), step.data(), sums.data()}, w, M, out);
    });
  });
}

#endif
