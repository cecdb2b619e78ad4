// The quantized GEMMs' shared parts (quant_gemm.cpp has the layout and the entry points): the packed weights of
// one GEMM, float16 scales, the outputs' stores, and the loop over tiles and blocks of rows that each kernel
// (quant_gemm_bf16.cpp, quant_gemm_i8.cpp, quant_gemm_i16.cpp, quant_gemm_f32.cpp) runs in.
#pragma once

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

constexpr int TILE = 16;        // output rows per tile of the packed layout
constexpr int GROUP = 32;       // activations per step (int16 path) and per sum of x (the minimum's term)
constexpr int SUPER = 256;      // weights per super-block (K-quants, IQ4_XS) along K
constexpr int NV = TILE / VL;   // vectors per tile: 1 (AVX-512), 2 (AVX2), 4 (baseline)

// How a group of activations with largest magnitude a is rounded to integers of at most `limit` (127: int8,
// 32767: int16): xq = (x up) scale. limit / a overflows float32 below a ~ 2^-113 (float32 reaches 2^-149), so such
// a group is scaled up by 2^100 first, exactly (a power of two); every other by 1. A zero group's scale is 0.
struct GroupRounding {
  float up, scale;
};
inline GroupRounding group_rounding(float a, float limit) {
  const float up = a < 0x1p-100f ? 0x1p100f : 1.0f;
  return {up, a > 0.0f ? limit / (a * up) : 0.0f};
}

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

typedef int8_t vsbyte __attribute__((vector_size(VL)));

// VL int8 -> float32 (exact). The intrinsics where there are: GCC's own conversion of a byte vector to floats
// went element by element (measured: Q4_K's GEMM at half Q4_1's speed per byte, one row of [8192, 2048])
inline vfloat load_bytes(const int8_t* p) {
#if defined(__AVX512F__)
  return bitcast<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return bitcast<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  vsbyte b;
  __builtin_memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(__builtin_convertvector(b, vint), vfloat);
#endif
}

// VL bytes at p, zero-extended to int32
inline vint load_ubytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return bitcast<vint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return bitcast<vint>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vint v;
  for (int l = 0; l < VL; ++l) v[l] = p[l];
  return v;
#endif
}

// How a packed weight holds its groups' scales d (and minimums m):
//   HALF_SCALES: float16 d and m per group (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, IQ4_NL, int4 and int8 made at load)
//   INT8_SUBS: an int8 sub-scale (and sub-minimum) per group times a super-block's float16 d (and m): Q6_K, IQ4_XS
//   SIX_BIT_SUBS: the same, the sub-scale and sub-minimum 6 bits each (0 .. 63: Q4_K, Q5_K), kept in the file's
//     12 bits a group rather than two bytes: per group, a byte a lane, sc & 15 | (m & 15) << 4; per super-block,
//     a 32-bit word a lane, group i's sc >> 4 at bits 2i, 2i + 1 and m >> 4 at bits 16 + 2i, 17 + 2i. Two bytes
//     a group made a Q4_K weight 148 bytes per 256 against the file's 144: 375 MiB of a 30B-A3B's 17 GiB.
enum ScaleForm { HALF_SCALES, INT8_SUBS, SIX_BIT_SUBS };

// Groups of 16 are Q6_K's (6-bit q, INT8_SUBS), whose minimum is -32 d: the file's w = d sc (q - 32) is
// (d sc) q + (-32 d sc), the sub-minimum the sub-scale and the super-block's minimum -32 d (model/gguf_blocks.py,
// which dequantizes blocks where -32 d is no float16). So m is d times -32, exact: no sub-minimum read, widened
// and multiplied, ~4% of a one-row Q6_K GEMM's instructions
constexpr int Q6_K_GROUP = 16;

// SIX_BIT_SUBS' sub-scales and sub-minimums of a group's lanes, from its bytes `low` (zero-extended) and the
// lanes' super-block words `high` shifted right by 2i for the super-block's group i: any vector of int32
template <class V>
inline void six_bit_subs(V low, V high, V& sc, V& m) {
  sc = (low & 15) | ((high & 3) << 4);
  m = (low >> 4) | ((high >> 12) & 48);
}

// One GEMM's weights (or one run of a fused layer's rows), as model/quant.py packs them: integers q of `bits`
// (4 to 6: 0 .. 2^bits - 1, in the nibble layouts; 8: int8) in groups of `group` (32, or 16 for Q6_K) along K,
// w = d q + m per group, d and m in one of the ScaleForms. The super-block forms' products (11 by at most 8
// significant bits) are exact in float32.
struct Packed {
  int bits, group;
  bool has_min;            // w = d q + m, else d q
  int64_t K, N;
  const uint8_t* w;        // [tiles, groups, group bytes]
  const at::Half* scale;   // [tiles, groups, 16] (HALF_SCALES)
  const at::Half* min;     // [tiles, groups, 16] (HALF_SCALES, with a minimum)
  const int8_t* sub;       // [tiles, groups, 16] (INT8_SUBS; SIX_BIT_SUBS: the low bits' bytes)
  const int8_t* sub_min;   // [tiles, groups, 16] (INT8_SUBS, with a minimum)
  const uint32_t* sub_high;  // [tiles, K / 256, 16] (SIX_BIT_SUBS: the high bits' words)
  const at::Half* super_d;  // [tiles, K / 256, 16]
  const at::Half* super_m;  // [tiles, K / 256, 16] (with a minimum)
  const float* bias;       // [N] or null
  const int8_t* levels;    // 4-bit q without a minimum: the 16 values q stands for (IQ4_LEVELS, MXFP4_LEVELS)
  int64_t num_groups;      // K / group, kept: not a division by the runtime group in every read of a scale

  int64_t groups() const { return num_groups; }
  int64_t supers() const { return K / SUPER; }
  int64_t group_bytes() const { return TILE * group * bits / 8; }
  int64_t tiles() const { return (N + TILE - 1) / TILE; }
  const uint8_t* tile(int64_t t) const { return w + t * groups() * group_bytes(); }
  ScaleForm scale_form() const { return sub_high ? SIX_BIT_SUBS : sub ? INT8_SUBS : HALF_SCALES; }

  // d and m (0 without a minimum) of lanes h VL .. h VL + VL - 1 of tile t's group g, float32 (exact)
  [[gnu::always_inline]] void group_scales(int64_t t, int64_t g, int h, vfloat& d, vfloat& m) const {
    const int64_t i = (t * groups() + g) * TILE + h * VL;
    if (!sub) {
      d = load_halves(scale + i);
      m = has_min ? load_halves(min + i) : vfloat{};
      return;
    }
    const int64_t s = (t * supers() + g * group / SUPER) * TILE + h * VL;
    vfloat sc, sm{};
    if (sub_high) {
      vint high, isc, im;
      __builtin_memcpy(&high, sub_high + s, sizeof(high));
      six_bit_subs(load_ubytes(reinterpret_cast<const uint8_t*>(sub) + i), high >> (2 * (g % (SUPER / GROUP))), isc, im);
      sc = __builtin_convertvector(isc, vfloat);
      sm = __builtin_convertvector(im, vfloat);
    } else {
      sc = load_bytes(sub + i);
      if (has_min && group != Q6_K_GROUP) sm = load_bytes(sub_min + i);
    }
    d = sc * load_halves(super_d + s);
    if (group == Q6_K_GROUP)
      m = -32.0f * d;
    else
      m = has_min ? sm * load_halves(super_m + s) : vfloat{};
  }
};

// The super-block forms' d and m (0 without a minimum) of lanes h VL .. h VL + VL - 1 of a tile's groups, for a
// kernel that walks a tile's groups in order: a super-block's scales (and high bits) are read once, at its first
// group, for each of the tile's NV vectors (Packed::group_scales' values, the same bits). With AVX2 (two vectors a
// tile) the one-row kernels read them through Packed::group_scales for every group, a call GCC kept out of line:
// ~40% of a one-row Q4_K GEMM's time (perf, Xeon forced to AVX2, [2048, 2048] in L2)
template <int FORM, bool MIN, int G>
struct SuperScales {
  vfloat super_d[NV]{}, super_m[NV]{};
  vint high[NV]{};  // SIX_BIT_SUBS

  void group(const Packed& w, int64_t t, int64_t g, int h, vfloat& d, vfloat& m) {
    static_assert(FORM != HALF_SCALES, "a super-block form");
    if (g % (SUPER / G) == 0) {
      const int64_t at = (t * w.supers() + g / (SUPER / G)) * TILE + h * VL;
      super_d[h] = load_halves(w.super_d + at);
      if constexpr (MIN && G != Q6_K_GROUP) super_m[h] = load_halves(w.super_m + at);
      if constexpr (FORM == SIX_BIT_SUBS) __builtin_memcpy(&high[h], w.sub_high + at, sizeof(high[h]));
    }
    const int64_t at = (t * w.groups() + g) * TILE + h * VL;
    if constexpr (FORM == SIX_BIT_SUBS) {
      vint sc, sm;
      six_bit_subs(load_ubytes(reinterpret_cast<const uint8_t*>(w.sub) + at), high[h] >> (2 * (g % (SUPER / G))), sc, sm);
      d = __builtin_convertvector(sc, vfloat) * super_d[h];
      m = __builtin_convertvector(sm, vfloat) * super_m[h];
    } else if constexpr (G == Q6_K_GROUP) {
      d = load_bytes(w.sub + at) * super_d[h];
      m = -32.0f * d;
    } else {
      d = load_bytes(w.sub + at) * super_d[h];
      m = MIN ? load_bytes(w.sub_min + at) * super_m[h] : vfloat{};
    }
  }
};

// Calls f(FORM), a std::integral_constant of the packed weight's ScaleForm
template <class F>
void dispatch_scales(const Packed& w, F&& f) {
  using std::integral_constant;
  switch (w.scale_form()) {
    case HALF_SCALES: return f(integral_constant<int, HALF_SCALES>{});
    case INT8_SUBS: return f(integral_constant<int, INT8_SUBS>{});
    case SIX_BIT_SUBS: return f(integral_constant<int, SIX_BIT_SUBS>{});
  }
}
// The forms a kernel of BITS, G, MIN can meet (others are not compiled): SIX_BIT_SUBS is Q4_K's and Q5_K's only
constexpr bool form_of(int form, int bits, int g, bool min) {
  return form != SIX_BIT_SUBS || (min && g == GROUP && (bits == 4 || bits == 5));
}

// What a 4-bit q without a minimum stands for, per format (Packed::levels; model/quant.py says which): IQ4_NL's
// and IQ4_XS's 16 levels (ggml-common.h kvalues_iq4nl), or MXFP4's E2M1 values doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6
// and their negatives, times 2: its scale is halved to match). Every level is a whole number below 128 in
// magnitude: exact as int8, int16 and bfloat16.
constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Calls f(BITS, G, MIN), each an std::integral_constant, for the packed form's kernel: 4-, 5- or 6-bit q
// (a nibble plane, and for 5 and 6 a high-bit plane) with a minimum, groups of 32 (16 for 6-bit: Q6_K); 4-bit
// without one: levels[q] (IQ4_NL, IQ4_XS, MXFP4); or 8-bit in groups of 32 without a minimum
template <class F>
void dispatch(const Packed& w, F&& f) {
  using std::integral_constant;
  const integral_constant<bool, true> min;
  const integral_constant<int, 32> g32;
  if (w.bits == 4 && !w.has_min)
    f(integral_constant<int, 4>{}, g32, integral_constant<bool, false>{});
  else if (w.bits == 4)
    f(integral_constant<int, 4>{}, g32, min);
  else if (w.bits == 5)
    f(integral_constant<int, 5>{}, g32, min);
  else if (w.bits == 6)
    f(integral_constant<int, 6>{}, integral_constant<int, 16>{}, min);
  else
    f(integral_constant<int, 8>{}, g32, integral_constant<bool, false>{});
}

// The nibble layouts' high bits (5- and 6-bit q: HB = 1 or 2 bits above the nibble). A group's packed bytes are
// its nibble plane (the 4-bit layout: chunks of 32 bytes, each lane's word holding q[4c] and q[4c + 2] in its
// first byte, q[4c + 1] and q[4c + 3] in its second), then its high-bit plane: rows of 16 bytes, one a lane, chunk
// c's 4 HB bits from bit 4 HB c of the lane's bytes: hi(q[4c]), hi(q[4c + 2]), hi(q[4c + 1]), hi(q[4c + 3]).
constexpr int64_t nibble_bytes(int G) { return TILE * G / 2; }
constexpr int64_t high_row(int HB, int c) { return 4 * HB * c / 8; }  // the 16-byte row holding chunk c's bits
constexpr int high_shift(int HB, int c) { return 4 * HB * c % 8; }

// Adds the high bits to 32-bit lanes holding two 16-bit q each, low: (q[4c], q[4c + 1]), high: (q[4c + 2],
// q[4c + 3]), each at bit 0 of its half; h: the lane's byte of the high-bit plane, shifted to the chunk's bits
template <int HB, class V>
inline void add_high(V h, V& low, V& high) {
  constexpr uint32_t m = (1u << HB) - 1, mask = (m << 4) | (m << 20);
  h &= (1u << (4 * HB)) - 1;
  const V t = h | (h << (16 - 2 * HB));  // bits 16 + 2 HB .. : hi(q[4c + 1]) and hi(q[4c + 3]) by 16
  low |= (t << 4) & mask;
  high |= (t << (4 - HB)) & mask;
}

// The avx2 tier's own nibble layout (its module packs and reads it alone; the AVX-512 tiers keep the one above).
// AVX2 on Intel issues three vector instructions a cycle, and the layout above took ~6 of them per 32 weights to
// unpack a 4-bit chunk, ~14 with Q6_K's high bits (a word widened, a shift, an or, a mask; for the high bits a
// byte widened, a shift, a two-uop vpmulld, shifts and masks): the one-row GEMM ran at 1.8x the time of reading
// its bytes (Xeon, Emerald Rapids). Here each lane's 32-bit word holds two chunks: byte i of chunk pair p holds
// lo(q[8p + i]) | lo(q[8p + 4 + i]) << 4, so one 32-byte load of 8 lanes gives chunk 2p with a mask and chunk
// 2p + 1 with a shift and a mask, q[4c .. 4c + 3] in the lane's bytes 0 .. 3 (what vpmaddubsw multiplies). The
// high-bit plane is a 32-bit word a lane, hi(q[4c + i]) at bit 8 i + HB c, so that one shift and one mask put a
// chunk's high bits at bit 4 of their bytes: [pairs of chunks][16 lanes][4 bytes], then [16 lanes][4 bytes].
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool PAIRED_CHUNKS = true;
#else
constexpr bool PAIRED_CHUNKS = false;
#endif

// q[k] of lane j of a packed group of G (bits 4 to 6: 0 .. 2^bits - 1; 8: int8 as it is), in this module's layout
inline int packed_q(const uint8_t* group, int G, int bits, int j, int k) {
  if (bits == 8) return static_cast<int8_t>(group[k / 2 * 32 + 2 * j + k % 2]);
  const int HB = bits - 4, c = k / 4, i = k % 4, mask = (1 << HB) - 1;
  if (PAIRED_CHUNKS) {
    const int low = (group[c / 2 * 64 + 4 * j + i] >> (4 * (c % 2))) & 15;
    if (!HB) return low;
    uint32_t high;
    __builtin_memcpy(&high, group + nibble_bytes(G) + 4 * j, sizeof(high));
    return low | ((high >> (8 * i + HB * c)) & mask) << 4;
  }
  const int low = (group[c * 32 + 2 * j + i % 2] >> (4 * (i / 2))) & 15;
  if (!HB) return low;
  constexpr int ORDER[4] = {0, 2, 1, 3};  // the high bits' order: q[4c], q[4c + 2], q[4c + 1], q[4c + 3]
  const int high = group[nibble_bytes(G) + high_row(HB, c) * TILE + j] >> high_shift(HB, c) >> (HB * ORDER[i]);
  return low | (high & mask) << 4;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Chunk c's q of lanes 8h .. 8h + 7 of a group in the paired layout: the lane's q[4c .. 4c + 3] in its bytes
template <int HB, int G>
inline __m256i chunk_quads(const uint8_t* group, int c, int h) {
  static_assert(HB * G / 4 <= 8, "a chunk's high bits in each byte of the lane's word");
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c / 2 * 64 + h * 32));
  __m256i q = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(w, 4) : w, _mm256_set1_epi8(15));
  if constexpr (HB > 0) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + nibble_bytes(G) + h * 32));
    const int shift = 4 - HB * c;  // to bit 4 of each byte
    const __m256i at4 = shift >= 0 ? _mm256_slli_epi32(high, shift) : _mm256_srli_epi32(high, -shift);
    q = _mm256_or_si256(q, _mm256_and_si256(at4, _mm256_set1_epi8(static_cast<char>(((1 << HB) - 1) << 4))));
  }
  return q;
}
#endif

// Where a GEMM's outputs go: [M, N] float32 (the logits, float32 models) or bfloat16, one of the two set
struct Output {
  float* f32;
  c10::BFloat16* bf16;
  int64_t ld;  // elements from one row to the next (a segment of a fused layer writes its columns only)

  // the first n of a tile's outputs y (+ bias) into row m at column n0, VL at a time
  void store(int64_t m, int64_t n0, int64_t n, const float* y, const float* bias) const {
    for (int64_t l0 = 0; l0 < n; l0 += VL) {
      const int64_t k = std::min<int64_t>(VL, n - l0);
      vfloat v, b{};
      __builtin_memcpy(&v, y + l0, sizeof(v));
      if (bias) __builtin_memcpy(&b, bias + n0 + l0, k * sizeof(float));
      v += b;
      if (k == VL) {  // one vector store: the copy of a run-time length went 8 bytes at a time
        f32 ? store_floats(v, f32 + m * ld + n0 + l0) : store_floats(v, bf16 + m * ld + n0 + l0);
      } else if (f32) {
        __builtin_memcpy(f32 + m * ld + n0 + l0, &v, k * sizeof(float));
      } else {
        const vhalfword h = to_bf16(v);
        __builtin_memcpy(bf16 + m * ld + n0 + l0, &h, k * sizeof(uint16_t));
      }
    }
  }
};

// How a kernel cuts one GEMM: blocks of up to `rows` rows of x, `tiles` tiles at once, from the tile's weights
// unpacked once (`unpack`: many rows reuse them) or from the packed bytes
struct Plan {
  int rows, tiles;
  bool unpack;
  bool full_blocks = false;  // blocks of `rows` from row 0, the last one shorter (else of as equal a size as can be)
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
//       m0 + r, from the unpacked tiles (one after the other) or, null, the packed ones; next: the tiles of a
//       later step, to prefetch
// A step asks for the weights of the step two ahead (within its thread's range), into L2: one step ahead into
// L1 kept the loads waiting on memory (1 row, cold, Q4_K 4096 x 1024 .. 16384 x 2048, Q4_1, Q6_K, Q8_0, 2
// threads on Zen 4: 21-27 GB/s, 23-37 GB/s this way; AVX2's kernel alike; 4 and 32 rows no slower)
constexpr int64_t PREFETCH_STEPS = 2;

// A kernel's state per thread for one loop (AMX's tile configuration), where it has one
template <class Kernel>
auto thread_scope(const Kernel& kernel, int) -> decltype(kernel.thread_scope()) {
  return kernel.thread_scope();
}
template <class Kernel>
int thread_scope(const Kernel&, long) {
  return 0;
}

template <class Kernel>
void run_tiles(const Kernel& kernel, const Packed& w, int64_t M, const Output& out) {
  const Plan plan = kernel.plan(M);
  const int64_t steps = (w.tiles() + plan.tiles - 1) / plan.tiles;
  const int64_t per_tile = w.groups() * Kernel::UNPACKED;
  at::parallel_for(0, steps, 1, [&](int64_t s0, int64_t s1) {
    [[maybe_unused]] const auto scope = thread_scope(kernel, 0);
    std::vector<typename Kernel::Unpacked> unpacked(plan.unpack ? plan.tiles * per_tile : 0);
    alignas(64) float y[Kernel::MAX_ROWS * Kernel::MAX_TILES * TILE];
    const int64_t blocks = (M + plan.rows - 1) / plan.rows;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t t = s * plan.tiles, nt = std::min<int64_t>(plan.tiles, w.tiles() - t);
      const int64_t n0 = t * TILE, n = std::min<int64_t>(nt * TILE, w.N - n0);
      if (plan.unpack)
        for (int64_t i = 0; i < nt; ++i) kernel.unpack(t + i, unpacked.data() + i * per_tile);
      for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
        const int64_t rest = M - m0;
        const int R = static_cast<int>(plan.full_blocks ? std::min<int64_t>(plan.rows, rest) : rest / (blocks - b));
        const int64_t ahead = std::min<int64_t>(PREFETCH_STEPS, s1 - 1 - s);
        const uint8_t* next = b == 0 && ahead > 0 ? w.tile(t + ahead * plan.tiles) : nullptr;  // once a step
        kernel.rows(R, static_cast<int>(nt), t, m0, plan.unpack ? unpacked.data() : nullptr, next, y);
        for (int r = 0; r < R; ++r) out.store(m0 + r, n0, n, y + r * nt * TILE, w.bias);
        m0 += R;
      }
    }
  });
}

// The kernels, each over x [M, K] (row-major): float32 activations as int16 (AVX2; on AMX's tiles where it has
// them) or as they are (baseline); bfloat16 ones as they are where the CPU multiplies them (AVX512-BF16), or
// rounded to int8 (with VNNI too, where a GEMM asks for it)
#if defined(__AVX2__)
void gemm_i16(const Packed& w, const float* x, int64_t M, const Output& out);
#else
void gemm_f32(const Packed& w, const float* x, int64_t M, const Output& out);
#endif
#if defined(__AVX512BF16__)
void gemm_bf16(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out);
#endif
#if defined(INT8_ACTIVATIONS)
// x rounded to int8 per row and 32 activations (quant_gemm_i8.cpp): once for every segment of a GEMM
struct Int8Activations {
  std::vector<int32_t> quads;      // [M, K / 4]: four int8 a word
  std::vector<float> step;         // [M, K / 32]
  std::vector<int32_t> half_sums;  // [M, K / 16]: the sum of each 16 xq
};
Int8Activations round_activations(const c10::BFloat16* x, int64_t M, int64_t K);
Int8Activations round_activations(const float* x, int64_t M, int64_t K);
void gemm_i8(const Packed& w, const Int8Activations& x, int64_t M, const Output& out);
#endif
#if defined(__AMX_INT8__)
// The largest |xq| gemm_i16 rounds x to for AMX's tiles (quant_gemm_amx.cpp): 128 F - 1 where q with a minimum
// (4 or 5 bits) times F = 2^(8 - bits) fits a byte (xq is then one byte product: 2047, 1023), else int16's
inline int amx_activation_limit(int bits, bool has_min) {
  return has_min && bits <= 5 ? (128 << (8 - bits)) - 1 : 32767;
}
// x as gemm_i16 rounds it: xq [M, K] int16, step [M, K / 32], xsum [M, K / group] (with a minimum)
void gemm_amx(const Packed& w, const int16_t* xq, const float* step, const float* xsum, int64_t M,
              const Output& out);
#endif
#if defined(__AMX_BF16__)
// x [blocks of 32 rows, K] bfloat16, zero rows past M: the weights dequantized to bfloat16 (quant_gemm_amx.cpp)
void gemm_amx_bf16(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out);
#endif
