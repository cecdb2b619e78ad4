// The quantized GEMM for bfloat16 activations rounded to int8, on CPUs with AVX512-VNNI and AVX512-BF16 (the
// avx512bf16 tier), for the GEMMs that ask for it (EngineConfig.gemm_activations "int8"): four byte products an
// instruction, ~1.4x the bfloat16 pairs' rate at many rows, llama.cpp's numerics rather than bfloat16's.
//
// Each group of 32 activations of a row is rounded to int8 against its largest magnitude a: x_k ~ s xq_k with
// s = a / 127, |xq_k| <= 127, an error of at most s / 2 (as llama.cpp's q8 activations; quant_gemm_i16.cpp does
// the same at 15 bits). vpdpbusd multiplies 16 lanes' four unsigned bytes by four signed ones and adds the four
// products into int32: 64 products an instruction, twice the bfloat16 pairs' 32 (a model of a tile's many-row
// loop: 1.75x the pairs' rate on Zen 4). The weights' bytes must be the unsigned side: 4- to 6-bit q are
// (0 .. 63); IQ4's and MXFP4's levels and Q8_0's int8 q are taken plus 128, and the 128 back with the group's
// offset, as a minimum: w = d q + m, or d (q + 128) + (-128 d). A group's sum is exact in int32 (|xq q| <= 127 *
// 255, 32 of them), so its additions' order changes nothing; the float32 work is per group, in a fixed order for
// every row on every path: y += (d s) sum_k xq_k q_k, then + m (s sum_k xq_k). A row's result is its rounded
// activations times the exact weights, whatever its batch.
//
// The packed layout (quant_gemm.cpp) gives each lane four q of a chunk: 4-bit, chunk c's 16-bit word of the
// lane holds q[4c], q[4c + 2] in its low byte and q[4c + 1], q[4c + 3] in its high byte; (w | w << 12) &
// 0x0F0F0F0F puts q[4c .. 4c + 3] in the lane's bytes 0 .. 3, against x's bytes xq[4c .. 4c + 3]. 8-bit: two
// chunks' 16-bit words, q[4c], q[4c + 1] and q[4c + 2], q[4c + 3].

#include "quant_gemm.h"

#if defined(INT8_ACTIVATIONS)

#include <cmath>
#include <limits>

namespace {

static_assert(VL == TILE, "one 16-lane vector per tile");

constexpr int MAX_ROWS = 8;  // rows of x computed together (accumulators kept in registers)

// One row's group of 32 bfloat16 activations rounded to int8 (to nearest, ties to even) with its step s, and
// the sums of its two halves' xq. A group holding an infinity or a NaN gets s = NaN: its outputs are NaN, as
// float32 arithmetic's would be.
inline void round_group(const c10::BFloat16* x, int8_t* q, float& step, int32_t* half_sums) {
  const __m512i words = _mm512_loadu_si512(x);  // 32 bfloat16: each the high half of its float32
  const __m512 low = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  const __m512 high = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m512 abs_low = _mm512_abs_ps(low), abs_high = _mm512_abs_ps(high);
  const __m512 finite = _mm512_set1_ps(std::numeric_limits<float>::max());  // (vmaxps drops a NaN: asked first)
  if (_mm512_cmp_ps_mask(abs_low, finite, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(abs_high, finite, _CMP_NLE_UQ)) {
    step = NAN;
    __builtin_memset(q, 0, GROUP);
    half_sums[0] = half_sums[1] = 0;
    return;
  }
  const float a = _mm512_reduce_max_ps(_mm512_max_ps(abs_low, abs_high));
  step = a / 127.0f;
  // 127 / a overflows below a ~ 2^-121 (bfloat16 reaches 2^-133): such a group is scaled up by 2^100 first,
  // exactly (a power of two), and every other multiplied by 1
  const float up = a < 0x1p-100f ? 0x1p100f : 1.0f;
  const __m512 scale = _mm512_set1_ps(a > 0.0f ? 127.0f / (a * up) : 0.0f), times = _mm512_set1_ps(up);
  // lane j of low is x[2j], of high x[2j + 1]; rounded to nearest, no xq passes 127 (x / a is at most 1 and
  // the product rounds at most an ulp above 127)
  const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(low, times), scale));
  const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(high, times), scale));
  // back in x's order: the 16-bit words (xq[2j] | xq[2j + 1] << 8) of the int32 lanes, as bytes
  const __m512i pairs = _mm512_or_si512(_mm512_and_si512(ql, _mm512_set1_epi32(0xFF)), _mm512_slli_epi32(qh, 8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(pairs));
  const __m512i sums = _mm512_add_epi32(ql, qh);  // lane j: k = 2j, 2j + 1; lanes 0 .. 7 the first 16 k
  half_sums[0] = _mm512_reduce_add_epi32(_mm512_maskz_mov_epi32(0x00FF, sums));
  half_sums[1] = _mm512_reduce_add_epi32(_mm512_maskz_mov_epi32(0xFF00, sums));
}

// the lanes' four bytes of chunk c of a 4-bit group: q[4c .. 4c + 3] (the header's layout)
inline __m512i nibble_quads(const uint8_t* group, int c) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * 32)));
  return _mm512_ternarylogic_epi32(w, _mm512_slli_epi32(w, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);  // (a|b)&c
}

// Chunk c's q of a group of G in the nibble layouts, as the lanes' four unsigned bytes; with HB high bits (5-,
// 6-bit q), or as the format's levels plus 128 (LEVELS: `table`, the 16 levels + 128 in each 128-bit lane)
template <int HB, int G, bool LEVELS>
inline __m512i quads(const uint8_t* group, int c, __m512i table) {
  const __m512i nibbles = nibble_quads(group, c);
  if constexpr (LEVELS) return _mm512_shuffle_epi8(table, nibbles);
  if constexpr (HB == 0) return nibbles;
  // The lane's byte of the high-bit plane, shifted to the chunk's bits, holds hi(q[4c]), hi(q[4c + 2]),
  // hi(q[4c + 1]), hi(q[4c + 3]), HB bits each from bit 0; each must reach bit 4 of its byte (bits 4, 12, 20, 28).
  // One vpmulld by 2^4 + 2^(20 - HB) makes two copies of the byte that do not overlap: the first puts hi(q[4c])
  // at bit 4, the second hi(q[4c + 2]) at bit 20; the product shifted by 8 - 2 HB puts hi(q[4c + 1]) at 12 and
  // hi(q[4c + 3]) at 28, and a mask keeps those four. The empty asm hides the constant: GCC made the product
  // shifts and adds.
  const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE;
  __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  if constexpr (high_shift(HB, 1) != 0)
    if (high_shift(HB, c) != 0) h = _mm512_srli_epi32(h, high_shift(HB, c));
  __m512i times = _mm512_set1_epi32((1 << 4) | (1 << (20 - HB)));
  asm("" : "+v"(times));
  const __m512i t = _mm512_mullo_epi32(h, times);
  const __m512i shifted = _mm512_slli_epi32(t, 8 - 2 * HB);
  const __m512i mask = _mm512_set1_epi32(HB == 1 ? 0x10101010 : 0x30303030);
  const __m512i high = _mm512_ternarylogic_epi32(t, shifted, mask, 0xA8);  // (a|b)&c
  return _mm512_or_si512(nibbles, high);
}

// Chunks 2c and 2c + 1 of an 8-bit group: q[4c .. 4c + 3] + 128 (int8 to unsigned: the sign bit flipped)
inline __m512i byte_quads(const uint8_t* group, int c) {
  const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * 64)));
  const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * 64 + 32)));
  return _mm512_ternarylogic_epi32(a, _mm512_slli_epi32(b, 16), _mm512_set1_epi32(static_cast<int>(0x80808080u)),
                                   0x56);  // (a|b)^c
}

// A format's 16 levels plus 128 (all in 1 .. 241) in each 128-bit lane, for vpshufb
inline __m512i levels_table(const int8_t* levels) {
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(levels));
  return _mm512_broadcast_i32x4(_mm_xor_si128(l, _mm_set1_epi8(static_cast<char>(0x80))));
}

inline __m512i dot_quads(__m512i acc, __m512i w, const int32_t* x) {
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x));
}

// x as the kernel reads it: int8 quads [M, K / 4], steps [M, K / 32], and per group of the weight's G the
// offset's factor s sum_k xq_k [M, K / G]
struct RoundedX {
  const int32_t* quads;
  const float* step;
  const float* offset_sum;
};

// BITS 4 to 6: the nibble layouts; 8: bytes (quant_gemm.h's dispatch); groups of G; MIN: w = d q + m, else
// levels[q] (4-bit) or q (8-bit), both plus 128. FORM: the scales' ScaleForm (quant_gemm.h)
template <int BITS, int G, bool MIN, int FORM>
struct I8Kernel {
  static constexpr bool NIB = BITS < 8;
  static constexpr int HB = NIB ? BITS - 4 : 0;
  static constexpr bool LEVELS = NIB && !MIN;
  static constexpr int QUADS = G / 4;  // vectors of the lanes' four bytes per group
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // One tile at a time; its groups unpacked once past a few blocks of rows (plain nibbles unpack in three
  // instructions a chunk, the others in more)
  static constexpr int PACKED_BLOCKS = NIB && HB == 0 && !LEVELS ? 4 : 2;
  Plan plan(int64_t M) const { return {MAX_ROWS, 1, M > PACKED_BLOCKS * MAX_ROWS}; }
  static constexpr int MAX_ROWS = ::MAX_ROWS, MAX_TILES = 1;
  using Unpacked = __m512i;
  static constexpr int UNPACKED = QUADS + 2;  // per group: its quads, then d and the offset (float32)

  const Packed& w;
  RoundedX x;

  __m512i quad(const uint8_t* group, int c, __m512i table) const {
    if constexpr (NIB)
      return quads<HB, G, LEVELS>(group, c, table);
    else
      return byte_quads(group, c);
  }

  // d and the offset (m, or -128 d where the bytes are q + 128) from scales read as the kernel walks the groups
  static void offset_of(vfloat d, vfloat& m) {
    if constexpr (!MIN) m = -128.0f * d;
  }

  void unpack(int64_t t, __m512i* out) const {
    const __m512i table = LEVELS ? levels_table(w.levels) : __m512i{};
    for (int64_t g = 0; g < w.groups(); ++g) {
      const uint8_t* wg = w.tile(t) + g * GROUP_BYTES;
      __m512i* u = out + g * UNPACKED;
      for (int c = 0; c < QUADS; ++c) u[c] = quad(wg, c, table);
      vfloat d, m;
      w.group_scales(t, g, 0, d, m);
      offset_of(d, m);
      u[QUADS] = bitcast<__m512i>(d);
      u[QUADS + 1] = bitcast<__m512i>(m);
    }
  }

  // A group's products in one chain a row from 4 rows up (as many chains as rows); below, two (even and odd
  // chunks), whose latency one chain would wait on. Integer sums: the same bits either way.
  // With next set, each group asks for a later tile's matching bytes ahead (quant_gemm.h, PREFETCH_STEPS): a
  // step reads its weights from memory (tens of MB), and the hardware's prefetcher alone stalls at each tile's
  // start (measured on the default model's GEMMs, cold, bfloat16 pairs: 1.10-1.24x at 1-8 rows, 1.04x at 32-64).
  template <int R>
  void rows(int64_t t, int64_t m0, const __m512i* unpacked, const uint8_t* next, float* out) const {
    constexpr bool TWO = R < 4;
    const uint8_t* wt = w.tile(t);
    const int64_t groups = w.groups(), K = w.K;
    const int32_t* xr[R];
    const float *step[R], *osum[R];
    for (int r = 0; r < R; ++r) {
      xr[r] = x.quads + (m0 + r) * (K / 4);
      step[r] = x.step + (m0 + r) * (K / GROUP);
      osum[r] = x.offset_sum + (m0 + r) * groups;
    }
    vfloat y[R];
    for (int r = 0; r < R; ++r) y[r] = vfloat{};
    [[maybe_unused]] SuperScales<FORM, MIN, G> supers;
    const __m512i table = LEVELS ? levels_table(w.levels) : __m512i{};
    for (int64_t g = 0; g < groups; ++g) {
      if (next)
        for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + g * GROUP_BYTES + i);
      __m512i even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
      const int64_t k0 = g * QUADS;  // the group's first quad of x
      const __m512i* u = unpacked ? unpacked + g * UNPACKED : nullptr;
      const uint8_t* wg = wt + g * GROUP_BYTES;
      for (int c = 0; c < QUADS; ++c) {
        const __m512i q = u ? u[c] : quad(wg, c, table);
        for (int r = 0; r < R; ++r) {
          if (TWO && c % 2)
            odd[r] = dot_quads(odd[r], q, xr[r] + k0 + c);
          else
            even[r] = dot_quads(even[r], q, xr[r] + k0 + c);
        }
      }
      vfloat d, m;
      if (u) {
        d = bitcast<vfloat>(u[QUADS]);
        m = bitcast<vfloat>(u[QUADS + 1]);
      } else {
        if constexpr (FORM != HALF_SCALES)
          supers.group(w, t, g, d, m);
        else
          w.group_scales(t, g, 0, d, m);
        offset_of(d, m);
      }
      const int64_t s = g * G / GROUP;  // x's step: per 32, a group of 16 takes its half's
      for (int r = 0; r < R; ++r) {
        const __m512i sum = TWO ? _mm512_add_epi32(even[r], odd[r]) : even[r];
        y[r] += __builtin_convertvector(bitcast<vint>(sum), vfloat) * (d * step[r][s]);
        y[r] += m * osum[r][g];
      }
    }
    for (int r = 0; r < R; ++r) __builtin_memcpy(out + r * TILE, &y[r], sizeof(y[r]));
  }

  void rows(int R, int /* one tile */, int64_t t, int64_t m0, const __m512i* unpacked, const uint8_t* next,
            float* out) const {
    switch (R) {
#define ROWS(n) \
  case n: return rows<n>(t, m0, unpacked, next, out);
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  }
};

}  // namespace

Int8Activations round_activations(const c10::BFloat16* x, int64_t M, int64_t K) {
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
