// The quantized GEMM on the baseline tier (no AVX2: x86-64's SSE2, arm64's NEON), float32 activations (bfloat16
// ones widened first). CPUs with AVX2 take quant_gemm_i16.cpp instead.
//
// Per group of 32 weights, a row's sum runs on the exact integers: sum_k x_k q_k in float32, one multiply-add
// after another, k ascending, then y += d * sum (+ m * sum_k x_k for 4-bit). q goes from the packed bytes to
// float32 exactly (an integer conversion), so nothing is rounded to a coarser weight.
//
// The packed layout is the one quant_gemm.cpp describes, read VL lanes at a time: 32 packed bytes hold 16 lanes'
// 16-bit words (bytes 2j, 2j + 1 of lane j), and one word holds the lane's q for 4 k (4-bit: k = 4c + i in bits
// 8i .. 8i + 3, k = 4c + 2 + i in bits 8i + 4 .. 8i + 7) or 2 k (8-bit: its two bytes).
//
// Each output lane's sum is one chain of 32 dependent multiply-adds per group, so a kernel keeps several chains
// in flight: one row takes two tiles at once (the weights straight from their packed bytes), more rows take one
// tile unpacked once into float32, in blocks of rows whose accumulators fill the 16 vector registers.

#include "quant_gemm.h"

#if !defined(__AVX2__)

namespace {

constexpr int TILES_AT_ONCE = 2;  // one row: 2 tiles x NV vectors of chains
constexpr int BLOCK_ROWS = 2;     // more rows: 2 x NV accumulators, NV weight vectors, x's broadcast

typedef uint16_t vword __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef int16_t vsword __attribute__((vector_size(VL * sizeof(int16_t))));

// a*b + c, as the target rounds it (one expression everywhere, so every path rounds alike)
inline vfloat madd(vfloat a, vfloat b, vfloat c) { return a * b + c; }

inline vfloat as_floats(vint q) { return __builtin_convertvector(q, vfloat); }

// v in every lane
inline vfloat splat(float v) {
  vfloat r;
  for (int l = 0; l < VL; ++l) r[l] = v;
  return r;
}

// lanes h*VL .. h*VL + VL - 1 of a chunk's 16 words, zero- or sign-extended to 32 bits
inline vint words(const uint8_t* chunk, int h) {
  vword w;
  __builtin_memcpy(&w, chunk + h * VL * 2, sizeof(w));
  return __builtin_convertvector(w, vint);
}
inline vint signed_words(const uint8_t* chunk, int h) {
  vsword w;
  __builtin_memcpy(&w, chunk + h * VL * 2, sizeof(w));
  return __builtin_convertvector(w, vint);
}

// The 4 (4-bit) or 2 (8-bit) k of chunk c as float32 vectors, lanes h*VL ..: q[k0 + i] * 2^s[i] in wf[i], each
// q masked where it lies in the word rather than shifted down first (one operation each instead of two):
// 4-bit s = (0, 8, 4, 0), the last by a shift; 8-bit s = (24, 0). The kernel multiplies them by x_k * 2^-s[i]
// (SCALES, applied to x once per GEMM), and (x_k 2^-s)(q 2^s) is x_k q exactly: the same products, the same
// sums, one operation less per k. (An |x_k| below ~1e-31 becomes 0 there: below what float32 sums keep anyway.)
constexpr float SCALES4[4] = {1.0f, 0x1p-8f, 0x1p-4f, 1.0f}, SCALES8[2] = {0x1p-24f, 1.0f};

inline void unpack4(const uint8_t* chunk, int h, vfloat* wf) {
  const vint w = words(chunk, h);
  wf[0] = as_floats(w & 0x000F);
  wf[1] = as_floats(w & 0x0F00);
  wf[2] = as_floats(w & 0x00F0);
  wf[3] = as_floats(w >> 12);
}
// 5- and 6-bit q (HB high bits) from a group's two planes (quant_gemm.h): each q whole, so SCALES are 1
template <int HB, int G>
inline void unpack_high(const uint8_t* group, int c, int h, vfloat* wf) {
  typedef uint8_t vbyte __attribute__((vector_size(VL)));
  const vint w = words(group + c * 32, h);
  vbyte b;
  __builtin_memcpy(&b, group + nibble_bytes(G) + high_row(HB, c) * TILE + h * VL, sizeof(b));
  const vint hb = __builtin_convertvector(b, vint) >> high_shift(HB, c);
  constexpr int m = (1 << HB) - 1;
  wf[0] = as_floats((w & 15) | ((hb & m) << 4));
  wf[2] = as_floats(((w >> 4) & 15) | (((hb >> HB) & m) << 4));
  wf[1] = as_floats(((w >> 8) & 15) | (((hb >> (2 * HB)) & m) << 4));
  wf[3] = as_floats(((w >> 12) & 15) | (((hb >> (3 * HB)) & m) << 4));
}
// 4-bit q without a minimum: levels[q] in k order, each whole (SCALES 1), lane by lane
inline void unpack_levels(const uint8_t* chunk, int h, const int8_t* levels, vfloat* wf) {
  const vint w = words(chunk, h);
  for (int l = 0; l < VL; ++l) {
    wf[0][l] = levels[w[l] & 15];
    wf[2][l] = levels[(w[l] >> 4) & 15];
    wf[1][l] = levels[(w[l] >> 8) & 15];
    wf[3][l] = levels[(w[l] >> 12) & 15];
  }
}
inline void unpack8(const uint8_t* chunk, int h, vfloat* wf) {
  const vint w = signed_words(chunk, h);
  wf[0] = as_floats(w << 24);
  wf[1] = as_floats(w >> 8);
}

// the sum of G float32, in a fixed order: VL-lane vectors added in turn, then a tree
template <int G>
inline float group_sum(const float* x) {
  vfloat s;
  __builtin_memcpy(&s, x, sizeof(s));
  for (int i = VL; i < G; i += VL) {
    vfloat v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    s += v;
  }
  return hsum(s);
}

// BITS 4 to 6: the nibble layouts, with a minimum; 8: bytes, without (quant_gemm.h's dispatch); groups of G
template <int BITS, int G, bool MIN>
struct F32Kernel {
  static constexpr bool Q4 = BITS < 8;  // the nibble layouts: 4 k per chunk
  static constexpr int HB = Q4 ? BITS - 4 : 0;
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // one row: tiles at once from the packed weights; more: one tile at a time, unpacked once there are two
  // blocks of rows to reuse it
  Plan plan(int64_t M) const {
    if (M == 1) return {1, TILES_AT_ONCE, false};
    return {BLOCK_ROWS, 1, M > BLOCK_ROWS};
  }
  static constexpr int MAX_ROWS = BLOCK_ROWS, MAX_TILES = TILES_AT_ONCE;
  using Unpacked = vfloat;
  // per group: q (scaled as unpack4 and unpack8 give it) as float32 for each k ([G][NV]), then d and m
  static constexpr int UNPACKED = (G + 2) * NV;
  static constexpr int PER_CHUNK = Q4 ? 4 : 2;  // k per chunk of 32 packed bytes

  const Packed& w;
  const float* x;     // [M, K], scaled: see SCALES4
  const float* xsum;  // [M, K / G] (with a minimum), of x as given

  static void unpack_chunk(const uint8_t* group, int c, int h, const int8_t* levels, vfloat* wf) {
    if constexpr (HB > 0)
      unpack_high<HB, G>(group, c, h, wf);
    else if constexpr (Q4 && !MIN)
      unpack_levels(group + c * 32, h, levels, wf);
    else if constexpr (Q4)
      unpack4(group + c * 32, h, wf);
    else
      unpack8(group + c * 32, h, wf);
  }

  void unpack(int64_t t, vfloat* out) const {
    const uint8_t* wt = w.tile(t);
    for (int64_t g = 0; g < w.groups(); ++g) {
      vfloat* o = out + g * UNPACKED;
      for (int c = 0; c < G / PER_CHUNK; ++c)
        for (int h = 0; h < NV; ++h) {
          vfloat wf[PER_CHUNK];
          unpack_chunk(wt + g * GROUP_BYTES, c, h, w.levels, wf);
          for (int i = 0; i < PER_CHUNK; ++i) o[(c * PER_CHUNK + i) * NV + h] = wf[i];
        }
      for (int h = 0; h < NV; ++h) w.group_scales(t, g, h, o[G * NV + h], o[(G + 1) * NV + h]);
    }
  }

  // y[r][tt * 16 ..] += a group's sums times d (+ m times the group's sum of x)
  template <int R, int TT>
  void add_group(const vfloat (&acc)[R][TT][NV], const vfloat (&d)[TT][NV], const vfloat (&m)[TT][NV],
                 int64_t m0, int64_t g, float* y) const {
    for (int r = 0; r < R; ++r)
      for (int tt = 0; tt < TT; ++tt)
        for (int h = 0; h < NV; ++h) {
          float* dst = y + (r * TT + tt) * TILE + h * VL;
          vfloat v;
          __builtin_memcpy(&v, dst, sizeof(v));
          v = madd(acc[r][tt][h], d[tt][h], v);
          if constexpr (MIN) v = madd(m[tt][h], splat(xsum[(m0 + r) * w.groups() + g]), v);
          __builtin_memcpy(dst, &v, sizeof(v));
        }
  }

  // R rows x TT tiles from the packed weights. The loops are unrolled whole, so that every accumulator's index
  // is a constant and it lives in a register (GCC kept some on the stack otherwise, each multiply-add then
  // waiting on a store and a load).
  template <int R, int TT>
  void packed_rows(int64_t t, int64_t m0, const uint8_t* next, float* y) const {
    const int64_t groups = w.groups();
    const uint8_t* wt[TT];
    for (int tt = 0; tt < TT; ++tt) wt[tt] = w.tile(t + tt);
    for (int64_t g = 0; g < groups; ++g) {
      if (next)  // the next step's tiles' bytes, group by group, asked for ahead: see quant_gemm_bf16.cpp
        for (int tt = 0; tt < TT; ++tt)
          for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + (tt * groups + g) * GROUP_BYTES + i);
      vfloat acc[R][TT][NV] = {};
      const float* xk = x + m0 * w.K + g * G;
#pragma GCC unroll 16
      for (int c = 0; c < G / PER_CHUNK; ++c)
#pragma GCC unroll 8
        for (int tt = 0; tt < TT; ++tt)
#pragma GCC unroll 4
          for (int h = 0; h < NV; ++h) {
            vfloat wf[PER_CHUNK];
            unpack_chunk(wt[tt] + g * GROUP_BYTES, c, h, w.levels, wf);
            for (int i = 0; i < PER_CHUNK; ++i)
              for (int r = 0; r < R; ++r)
                acc[r][tt][h] = madd(wf[i], splat(xk[r * w.K + c * PER_CHUNK + i]), acc[r][tt][h]);
          }
      vfloat d[TT][NV], m[TT][NV];
      for (int tt = 0; tt < TT; ++tt)
        for (int h = 0; h < NV; ++h) w.group_scales(t + tt, g, h, d[tt][h], m[tt][h]);
      add_group<R, TT>(acc, d, m, m0, g, y);
    }
  }

  // R rows of one tile, unpacked: per k, the tile's NV weight vectors are loaded once for all R rows
  template <int R>
  void unpacked_rows(int64_t m0, const vfloat* unpacked, float* y) const {
    for (int64_t g = 0; g < w.groups(); ++g) {
      const vfloat* u = unpacked + g * UNPACKED;
      vfloat acc[R][1][NV] = {};
      const float* xk = x + m0 * w.K + g * G;
#pragma GCC unroll 32
      for (int k = 0; k < G; ++k)
        for (int r = 0; r < R; ++r) {
          const vfloat xb = splat(xk[r * w.K + k]);
          for (int h = 0; h < NV; ++h) acc[r][0][h] = madd(u[k * NV + h], xb, acc[r][0][h]);
        }
      vfloat d[1][NV], m[1][NV];
      for (int h = 0; h < NV; ++h) {
        d[0][h] = u[G * NV + h];
        m[0][h] = u[(G + 1) * NV + h];
      }
      add_group<R, 1>(acc, d, m, m0, g, y);
    }
  }

  void rows(int R, int nt, int64_t t, int64_t m0, const vfloat* unpacked, const uint8_t* next, float* y) const {
    std::fill(y, y + R * nt * TILE, 0.0f);
    if (unpacked) {  // one tile (the plan's)
      if (R == 1) return unpacked_rows<1>(m0, unpacked, y);
      return unpacked_rows<2>(m0, unpacked, y);
    }
    if (R == 2) return packed_rows<2, 1>(t, m0, next, y);
    if (nt == 2) return packed_rows<1, 2>(t, m0, next, y);
    return packed_rows<1, 1>(t, m0, next, y);
  }
};

void gemm(const Packed& w, const float* x, int64_t M, const Output& out) {
  dispatch(w, [&](auto bits, auto g, auto min) {
    constexpr int G = g();
    const int64_t groups = w.K / G;
    std::vector<float> xsum(min() ? M * groups : 0);  // each row's sum over each group (the m term)
    std::vector<float> scaled(M * w.K);               // x_k * 2^-s: see SCALES4 (1 for 5- and 6-bit q)
    at::parallel_for(0, M * groups, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float* src = x + i * G;
        if constexpr (min()) xsum[i] = group_sum<G>(src);
        for (int k = 0; k < G; ++k)
          scaled[i * G + k] = src[k] * (bits() == 4 && min() ? SCALES4[k % 4] : bits() == 8 ? SCALES8[k % 2] : 1.0f);
      }
    });
    run_tiles(F32Kernel<bits(), G, min()>{w, scaled.data(), xsum.data()}, w, M, out);
  });
}

}  // namespace

void gemm_f32(const Packed& w, const float* x, int64_t M, const Output& out) { gemm(w, x, M, out); }

#endif
