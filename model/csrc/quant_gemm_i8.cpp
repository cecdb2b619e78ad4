// The quantized GEMM on activations rounded to int8, for the GEMMs that ask for it (EngineConfig.gemm_activations
// "int8"): bfloat16 ones on CPUs with AVX512-VNNI and AVX512-BF16 (the avx512bf16 tier), float32 (or bfloat16)
// ones with AVX2 alone (the avx2 tier). Faster at many rows than the tiers' own (bfloat16 pairs, int16 pairs),
// llama.cpp's numerics rather than theirs.
//
// Each group of 32 activations of a row is rounded to int8 against its largest magnitude a: x_k ~ s xq_k with
// s = a / 127, |xq_k| <= 127, an error of at most s / 2 (as llama.cpp's q8 activations; quant_gemm_i16.cpp does
// the same at 15 bits). The products take the lanes' four unsigned bytes times four signed ones into int32: one
// vpdpbusd for 16 lanes with VNNI, 64 products an instruction, twice the bfloat16 pairs' 32 (a model of a tile's
// many-row loop: 1.75x the pairs' rate on Zen 4); with AVX2, vpmaddubsw (pairs into int16) and vpmaddwd (pairs of
// those into int32) for 8 lanes, where the int16 kernel's vpmaddwd took two for the same 32 products and twice the
// bytes of x. The weights' bytes are the unsigned side: 4- to 6-bit q are (0 .. 63); IQ4's and MXFP4's levels and
// Q8_0's int8 q are taken plus 128, and the 128 back with the group's offset, as a minimum: w = d q + m, or
// d (q + 128) + (-128 d). vpmaddubsw's int16 pair sums would pass 2^15 with them (2 * 255 * 127), so with AVX2
// those signed bytes stay as they are and give x their sign (vpsignb), without an offset.
// A group's sum is exact in int32 (|xq q| <= 127 * 255, 32 of them), so its additions' order changes nothing; the
// float32 work is per group, in a fixed order for every row on every path: y += (d s) sum_k xq_k q_k, then
// + m (s sum_k xq_k). A row's result is its rounded activations times the exact weights, whatever its batch.
//
// The packed layout (quant_gemm.cpp; the avx2 tier's own: quant_gemm.h, PAIRED_CHUNKS) gives each lane four q of
// a chunk. In the shared one: 4-bit, chunk c's 16-bit word of the lane holds q[4c], q[4c + 2] in its low byte and
// q[4c + 1], q[4c + 3] in its high byte; (w | w << 12) & 0x0F0F0F0F puts q[4c .. 4c + 3] in the lane's bytes
// 0 .. 3, against x's bytes xq[4c .. 4c + 3]. 8-bit: two chunks' 16-bit words, q[4c], q[4c + 1] and q[4c + 2],
// q[4c + 3].

#include "quant_gemm.h"

#if defined(INT8_ACTIVATIONS)

#include <cmath>
#include <limits>

namespace {

#if defined(__AVX512VNNI__)
constexpr bool VNNI = true;
constexpr int MAX_ROWS = 8, ROWS_FROM_PACKED = 8;  // rows of x computed together (accumulators in registers: 32)
#else
constexpr bool VNNI = false;
// 16 registers: blocks of up to 4 rows, both halves of a tile at once; 4-bit q with a minimum from unpacked tiles
// (a prefill's and a busy step's Q4_K), 8 rows one half at a time (I8Kernel::HALF_PASSES)
constexpr int ROWS_FROM_PACKED = 4;
constexpr int MAX_ROWS = 8;
#endif

typedef int8_t vbyte4 __attribute__((vector_size(VL * 4)));  // a vector's bytes

// VL float32 -> int32, to nearest, ties to even
inline vint round_lanes(vfloat v) {
#if defined(__AVX512F__)
  return bitcast<vint>(_mm512_cvtps_epi32(bitcast<__m512>(v)));
#else
  return bitcast<vint>(_mm256_cvtps_epi32(bitcast<__m256>(v)));
#endif
}

// One row's group of 32 activations rounded to int8 (to nearest, ties to even) with its step s, and the sums of
// its two halves' xq. A group holding an infinity or a NaN gets s = NaN: its outputs are NaN, as float32
// arithmetic's would be.
template <typename T>
inline void round_group(const T* x, int8_t* q, float& step, int32_t* half_sums) {
  constexpr int N = GROUP / VL;
  vfloat v[N], largest{};
  for (int i = 0; i < N; ++i) {
    v[i] = load_floats(x + i * VL);
    const vfloat magnitude = bitcast<vfloat>(bitcast<vuint>(v[i]) & 0x7FFFFFFFu);
    // an infinity or a NaN (whose comparisons are false) somewhere: vmaxps would drop the NaN
    const vint finite = magnitude <= std::numeric_limits<float>::max();
    bool all_finite = true;
    for (int l = 0; l < VL; ++l) all_finite &= finite[l] != 0;
    if (!all_finite) {
      step = NAN;
      __builtin_memset(q, 0, GROUP);
      half_sums[0] = half_sums[1] = 0;
      return;
    }
    largest = largest > magnitude ? largest : magnitude;
  }
  float a = 0.0f;
  for (int l = 0; l < VL; ++l) a = std::max(a, largest[l]);
  step = a / 127.0f;
  const auto [up, scale] = group_rounding(a, 127.0f);
  // rounded to nearest, no xq passes 127: x / a is at most 1, and the product rounds at most an ulp above 127
  vint r[N];
  for (int i = 0; i < N; ++i) r[i] = round_lanes((v[i] * up) * scale);
#if defined(__AVX512F__)
  for (int i = 0; i < N; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * VL), _mm512_cvtepi32_epi8(bitcast<__m512i>(r[i])));
#else
  // packs interleaves 128-bit halves: put them back in order (no value saturates)
  const __m256i words = _mm256_packs_epi32(bitcast<__m256i>(r[0]), bitcast<__m256i>(r[1]));
  const __m256i words2 = _mm256_packs_epi32(bitcast<__m256i>(r[2]), bitcast<__m256i>(r[3]));
  const __m256i bytes = _mm256_packs_epi16(words, words2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
  vint low{}, high{};  // the first 16 xq and the last
  for (int i = 0; i < N; ++i) (i < N / 2 ? low : high) += r[i];
  half_sums[0] = half_sums[1] = 0;
  for (int l = 0; l < VL; ++l) {
    half_sums[0] += low[l];
    half_sums[1] += high[l];
  }
}

// VL 16-bit words at p, zero-extended to int32
inline vuint load_words(const uint8_t* p) {
#if defined(__AVX512F__)
  return bitcast<vuint>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return bitcast<vuint>(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
}

// table[i] for each byte i (0 .. 15) of idx: a byte shuffle within each 128-bit lane
inline vuint shuffle_bytes(vuint table, vuint idx) {
#if defined(__AVX512F__)
  return bitcast<vuint>(_mm512_shuffle_epi8(bitcast<__m512i>(table), bitcast<__m512i>(idx)));
#else
  return bitcast<vuint>(_mm256_shuffle_epi8(bitcast<__m256i>(table), bitcast<__m256i>(idx)));
#endif
}

// A format's 16 levels in each 128-bit lane, for shuffle_bytes: plus 128 (all in 1 .. 241) where the weights
// are the unsigned side, as they are where AVX2 gives x their sign
inline vuint levels_table(const int8_t* levels, bool plus_128) {
  vbyte4 t;
  for (int i = 0; i < VL * 4; ++i) t[i] = static_cast<int8_t>(levels[i % 16] ^ (plus_128 ? 0x80 : 0));
  return bitcast<vuint>(t);
}

#if !defined(__AVX512VNNI__)
// AVX2's two steps: the lanes' pairs of products of q (unsigned bytes) and x's four bytes, as int16 (each below
// 2^15), and a vector of those pairs summed into int32 per lane
inline __m256i product_pairs(vuint q, const int32_t* x) {
  return _mm256_maddubs_epi16(bitcast<__m256i>(q), _mm256_set1_epi32(*x));
}
inline vint widen_pairs(vint acc, __m256i pairs) {
  return acc + bitcast<vint>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

// acc + the lanes' four products of q (unsigned bytes) and x's four bytes (signed, the same in every lane)
inline vint dot_quads(vint acc, vuint q, const int32_t* x) {
#if defined(__AVX512VNNI__)
  return bitcast<vint>(_mm512_dpbusd_epi32(bitcast<__m512i>(acc), bitcast<__m512i>(q), _mm512_set1_epi32(*x)));
#else
  return widen_pairs(acc, product_pairs(q, x));
#endif
}

#if !defined(__AVX512VNNI__)
// The same for signed bytes q (AVX2's levels and 8-bit q): |q| times x with q's sign, each pair below 2^15
inline vint dot_signed_quads(vint acc, vuint q, const int32_t* x) {
  const __m256i w = bitcast<__m256i>(q), xs = _mm256_sign_epi8(_mm256_set1_epi32(*x), w);
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), xs);
  return acc + bitcast<vint>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

// x as the kernel reads it: int8 quads [M, K / 4], steps [M, K / 32], and per group of the weight's G the
// offset's factor s sum_k xq_k [M, K / G]
struct RoundedX {
  const int32_t* quads;
  const float* step;
  const float* offset_sum;
};

// BITS 4 to 6: the nibble layouts; 8: bytes (quant_gemm.h's dispatch); groups of G; MIN: w = d q + m, else
// levels[q] (4-bit) or q (8-bit). FORM: the scales' ScaleForm (quant_gemm.h)
template <int BITS, int G, bool MIN, int FORM>
struct I8Kernel {
  static constexpr bool NIB = BITS < 8;
  static constexpr int HB = NIB ? BITS - 4 : 0;
  static constexpr bool LEVELS = NIB && !MIN;
  static constexpr bool SIGNED = !MIN && !VNNI;  // the weights' bytes signed, x taking their sign (AVX2)
  static constexpr int QUADS = G / 4;  // vectors of the lanes' four bytes per group and half tile
  // With AVX2, q of 4 bits (below 16) times |xq| <= 127 keep a group's product pairs below 2^15 (8 chunks x 2 x
  // 15 x 127 = 30,480): they are summed in int16 and widened once a group, one multiply a chunk where two were
  // (~1.2x at 4 to 32 rows, Q4_K and Q4_1 on Zen 4). 5 bits widen every 4 chunks (4 x 2 x 31 x 127 = 31,496), 6
  // every 2 (2 x 2 x 63 x 127 = 32,004): ~1.2x for Q6_K's many rows once its unpacking got cheap (Xeon).
  static constexpr bool INT16_PAIRS = !VNNI && NIB && MIN;
  static constexpr int WIDEN_EVERY = BITS == 4 ? QUADS : BITS == 5 ? 4 : 2;  // chunks summed in int16
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // With AVX2, a row's int16 pairs of a whole group are one register a half: 8 rows of a half at once hold 8 of
  // them, where 4 rows of both halves spilled their sums (Xeon forced AVX2, Q4_K at 512 rows: 1.15x). 5 and 6 bits
  // widen their pairs on the way: 6 rows of a half at a time spilled (Q6_K 0.8x), so they keep 4 rows of both.
  static constexpr bool HALF_PASSES = !VNNI && BITS == 4 && MIN;
  static constexpr int UNPACKED_ROWS = HALF_PASSES ? 8 : ROWS_FROM_PACKED;
  // One tile at a time; its groups unpacked once past a few blocks of rows (plain nibbles unpack in three or
  // four instructions a chunk, the others in more), and past one where 8 rows go at once (a prefill's experts
  // of 5 to 16 rows 1.2-1.4x, Xeon forced AVX2)
  static constexpr int PACKED_BLOCKS = HALF_PASSES ? 1 : NIB && HB == 0 && !LEVELS ? 4 : 2;
  Plan plan(int64_t M) const {
    const bool unpack = M > PACKED_BLOCKS * ROWS_FROM_PACKED;
    return {unpack ? UNPACKED_ROWS : ROWS_FROM_PACKED, 1, unpack};
  }
  static constexpr int MAX_ROWS = ::MAX_ROWS, MAX_TILES = 1;
  using Unpacked = vuint;
  static constexpr int UNPACKED = (QUADS + 2) * NV;  // per group: its quads, then d and the offset (float32)

  const Packed& w;
  RoundedX x;

  // Chunk c's q (the lanes of half h): the lanes' four bytes
  vuint quad(const uint8_t* group, int c, int h, vuint table) const {
    if constexpr (!NIB) {
      const vuint a = load_words(group + c * 64 + h * 2 * VL), b = load_words(group + c * 64 + 32 + h * 2 * VL);
      return (a | (b << 16)) ^ (SIGNED ? 0u : 0x80808080u);  // plus 128: the sign bit flipped
    }
#if defined(__AVX2__) && !defined(__AVX512F__)
    {  // the avx2 tier's paired chunks (quant_gemm.h): a mask, or a shift and a mask, and for 5 and 6 bits two more
      const vuint q = bitcast<vuint>(chunk_quads<HB, G>(group, c, h));
      if constexpr (LEVELS) return shuffle_bytes(table, q);
      return q;
    }
#endif
    const vuint w = load_words(group + c * 32 + h * 2 * VL);
    const vuint nibbles = (w | (w << 12)) & 0x0F0F0F0Fu;
    if constexpr (LEVELS) return shuffle_bytes(table, nibbles);
    if constexpr (HB == 0) return nibbles;
    // The lane's byte of the high-bit plane, shifted to the chunk's bits, holds hi(q[4c]), hi(q[4c + 2]),
    // hi(q[4c + 1]), hi(q[4c + 3]), HB bits each from bit 0; each must reach bit 4 of its byte (bits 4, 12, 20,
    // 28). One vpmulld by 2^4 + 2^(20 - HB) makes two copies of the byte that do not overlap: the first puts
    // hi(q[4c]) at bit 4, the second hi(q[4c + 2]) at bit 20; the product shifted by 8 - 2 HB puts hi(q[4c + 1])
    // at 12 and hi(q[4c + 3]) at 28, and a mask keeps those four. The empty asm hides the constant: GCC made the
    // product shifts and adds.
    const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE + h * VL;
    vuint high = bitcast<vuint>(load_ubytes(row)) >> high_shift(HB, c);
    vuint times = vuint{} + ((1u << 4) | (1u << (20 - HB)));
    asm("" : "+v"(times));
    const vuint t = high * times;
    return nibbles | ((t | (t << (8 - 2 * HB))) & (HB == 1 ? 0x10101010u : 0x30303030u));
  }

  static vint dot(vint acc, vuint q, const int32_t* x) {
#if !defined(__AVX512VNNI__)
    if constexpr (SIGNED) return dot_signed_quads(acc, q, x);
#endif
    return dot_quads(acc, q, x);
  }

  // the offset: m, -128 d where the bytes are q + 128, none where x takes their sign
  static void offset_of(vfloat d, vfloat& m) {
    if constexpr (!MIN) m = SIGNED ? vfloat{} : -128.0f * d;
  }

  void scales(int64_t t, int64_t g, int h, [[maybe_unused]] SuperScales<FORM, MIN, G>& supers, vfloat& d,
              vfloat& m) const {
    if constexpr (FORM != HALF_SCALES)
      supers.group(w, t, g, h, d, m);  // a super-block's scales read once for its groups
    else
      w.group_scales(t, g, h, d, m);
    offset_of(d, m);
  }

  void unpack(int64_t t, vuint* out) const {
    const vuint table = LEVELS ? levels_table(w.levels, !SIGNED) : vuint{};
    [[maybe_unused]] SuperScales<FORM, MIN, G> supers;
    for (int64_t g = 0; g < w.groups(); ++g) {
      const uint8_t* wg = w.tile(t) + g * GROUP_BYTES;
      vuint* u = out + g * UNPACKED;
      for (int h = 0; h < NV; ++h) {
        for (int c = 0; c < QUADS; ++c) u[c * NV + h] = quad(wg, c, h, table);
        vfloat d, m;
        scales(t, g, h, supers, d, m);
        u[QUADS * NV + h] = bitcast<vuint>(d);
        u[(QUADS + 1) * NV + h] = bitcast<vuint>(m);
      }
    }
  }

  // A group's products in one chain a row and half tile, but for a few rows of one-vector tiles: two (even and
  // odd chunks), whose latency one chain would wait on. Integer sums: the same bits either way.
  // With next set, each group asks for a later tile's matching bytes ahead (quant_gemm.h, PREFETCH_STEPS): a
  // step reads its weights from memory (tens of MB), and the hardware's prefetcher alone stalls at each tile's
  // start (measured on the default model's GEMMs, cold, bfloat16 pairs: 1.10-1.24x at 1-8 rows, 1.04x at 32-64).
  template <int R, int HA>
  void rows(int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next, float* out) const {
    constexpr bool TWO = NV == 1 && R < 4;
    const uint8_t* wt = w.tile(t);
    const int64_t groups = w.groups(), K = w.K;
    const int32_t* xr[R];
    const float *step[R], *osum[R];
    for (int r = 0; r < R; ++r) {
      xr[r] = x.quads + (m0 + r) * (K / 4);
      step[r] = x.step + (m0 + r) * (K / GROUP);
      osum[r] = x.offset_sum + (m0 + r) * groups;
    }
    vfloat y[R][NV];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < NV; ++h) y[r][h] = vfloat{};
    const vuint table = LEVELS ? levels_table(w.levels, !SIGNED) : vuint{};
    for (int h0 = 0; h0 < NV; h0 += HA) {  // HA halves of the tile a pass
      [[maybe_unused]] SuperScales<FORM, MIN, G> supers;
      for (int64_t g = 0; g < groups; ++g) {
        if (next && h0 == 0)
          for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + g * GROUP_BYTES + i);
        vint even[R][HA], odd[R][HA];
        for (int r = 0; r < R; ++r)
          for (int i = 0; i < HA; ++i) even[r][i] = odd[r][i] = vint{};
        const int64_t k0 = g * QUADS;  // the group's first quad of x
        const vuint* u = unpacked ? unpacked + g * UNPACKED : nullptr;
        const uint8_t* wg = wt + g * GROUP_BYTES;
#if !defined(__AVX512VNNI__)
        if constexpr (INT16_PAIRS) {
          __m256i pairs[R][HA] = {};
#pragma GCC unroll 8
          for (int c = 0; c < QUADS; ++c) {
            for (int i = 0; i < HA; ++i) {
              const int h = h0 + i;
              const vuint q = u ? u[c * NV + h] : quad(wg, c, h, table);
              for (int r = 0; r < R; ++r)
                pairs[r][i] = _mm256_add_epi16(pairs[r][i], product_pairs(q, xr[r] + k0 + c));
            }
            if ((c + 1) % WIDEN_EVERY == 0)
              for (int r = 0; r < R; ++r)
                for (int i = 0; i < HA; ++i) {
                  even[r][i] = widen_pairs(even[r][i], pairs[r][i]);
                  pairs[r][i] = __m256i{};
                }
          }
        } else
#endif
          for (int c = 0; c < QUADS; ++c)
            for (int i = 0; i < HA; ++i) {
              const int h = h0 + i;
              const vuint q = u ? u[c * NV + h] : quad(wg, c, h, table);
              for (int r = 0; r < R; ++r) {
                if (TWO && c % 2)
                  odd[r][i] = dot(odd[r][i], q, xr[r] + k0 + c);
                else
                  even[r][i] = dot(even[r][i], q, xr[r] + k0 + c);
              }
            }
        const int64_t s = g * G / GROUP;  // x's step: per 32, a group of 16 takes its half's
        for (int i = 0; i < HA; ++i) {
          const int h = h0 + i;
          vfloat d, m;
          if (u) {
            d = bitcast<vfloat>(u[QUADS * NV + h]);
            m = bitcast<vfloat>(u[(QUADS + 1) * NV + h]);
          } else {
            scales(t, g, h, supers, d, m);
          }
          for (int r = 0; r < R; ++r) {
            const vint sum = TWO ? even[r][i] + odd[r][i] : even[r][i];
            y[r][h] += __builtin_convertvector(sum, vfloat) * (d * step[r][s]);
            if constexpr (!SIGNED) y[r][h] += m * osum[r][g];
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < NV; ++h) __builtin_memcpy(out + r * TILE + h * VL, &y[r][h], sizeof(y[r][h]));
  }

  void rows(int R, int /* one tile */, int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next,
            float* out) const {
    switch (R) {
#define ROWS(n)                                                                                \
  case n:                                                                                      \
    if constexpr (n <= MAX_ROWS) {                                                             \
      if constexpr (HALF_PASSES)                                                               \
        if (unpacked) return rows<n, 1>(t, m0, unpacked, next, out);                          \
      if constexpr (n <= ROWS_FROM_PACKED) return rows<n, NV>(t, m0, unpacked, next, out);         \
    }
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
    TORCH_CHECK(false, "quant_gemm: no kernel for blocks of ", R, " rows");
  }
};

template <typename T>
Int8Activations round_rows(const T* x, int64_t M, int64_t K) {
  Int8Activations a;
  a.quads.resize(M * K / 4);
  a.step.resize(M * K / GROUP);
  a.half_sums.resize(M * K / 16);
  auto* q = reinterpret_cast<int8_t*>(a.quads.data());
  at::parallel_for(0, M * K / GROUP, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) round_group(x + i * GROUP, q + i * GROUP, a.step[i], a.half_sums.data() + 2 * i);
  });
  return a;
}

}  // namespace

Int8Activations round_activations(const c10::BFloat16* x, int64_t M, int64_t K) { return round_rows(x, M, K); }
Int8Activations round_activations(const float* x, int64_t M, int64_t K) { return round_rows(x, M, K); }

void gemm_i8(const Packed& w, const Int8Activations& a, int64_t M, const Output& out) {
  dispatch(w, [&](auto bits, auto g, auto min) {
    constexpr int G = g();
    // The offset's factor per group: s sum_k xq_k, the rounded activations' own sum (exact in int32, then one
    // rounding), so that the offset too multiplies the rounded x (quant_gemm_i16.cpp says why)
    const int64_t groups = M * w.K / G;
    std::vector<float> offset_sum(groups);
    at::parallel_for(0, groups, 256, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int32_t total = G == 16 ? a.half_sums[i] : a.half_sums[2 * i] + a.half_sums[2 * i + 1];
        offset_sum[i] = a.step[i * G / GROUP] * static_cast<float>(total);
      }
    });
    const RoundedX x{a.quads.data(), a.step.data(), offset_sum.data()};
    dispatch_scales(w, [&](auto form) {
      if constexpr (form_of(form(), bits(), G, min())) run_tiles(I8Kernel<bits(), G, min(), form()>{w, x}, w, M, out);
    });
  });
}

#endif
