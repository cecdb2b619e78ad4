// The quantized GEMM for bfloat16 activations on CPUs with AVX512-BF16 (the avx512bf16 tier; elsewhere
// bfloat16 activations are widened to float32 and take quant_gemm_f32.cpp).
//
// The integers are exact in bfloat16, so a group's sum runs on the exact weights: sum_k x_k q_k, from bfloat16
// pair products (exact in float32, one vdpbf16ps per pair of k for 16 lanes; in groups of 32, two chains, the
// group's even and odd pair vectors, added at the group's end: the same order for every row in every path), then
// times d (plus m * sum_k x_k).
// A 4- to 6-bit q is turned into a bfloat16 by writing it into the mantissa of 128.0, which gives 128 + q; the
// 128 * sum_k x_k that adds is taken back with the offset m - 128 d.

#include "quant_gemm.h"

#if defined(__AVX512BF16__)

namespace {

static_assert(VL == TILE, "one 16-lane vector per tile");

typedef uint16_t vword32 __attribute__((vector_size(64)));

constexpr int MAX_ROWS = 8;  // rows of x computed together (accumulators kept in registers)

// acc + the pairwise dot products of 16 lanes of bfloat16 pairs: w (packed weights) and x (one pair, the same
// in every lane)
inline vfloat dot_pairs(vfloat acc, vuint w, uint32_t x) {
  return bitcast<vfloat>(_mm512_dpbf16_ps(bitcast<__m512>(acc), bitcast<__m512bh>(w),
                                          bitcast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)))));
}

// IQ4_LEVELS as bfloat16 bits (exact), twice over: vpermw indexes 32 words
alignas(64) constexpr uint16_t IQ4_BF16[32] = {
    0xC2FE, 0xC2D0, 0xC2A6, 0xC282, 0xC244, 0xC20C, 0xC1B0, 0xC120, 0x3F80, 0x4150, 0x41C8, 0x4218, 0x4254, 0x428A, 0x42B2, 0x42E2,
    0xC2FE, 0xC2D0, 0xC2A6, 0xC282, 0xC244, 0xC20C, 0xC1B0, 0xC120, 0x3F80, 0x4150, 0x41C8, 0x4218, 0x4254, 0x428A, 0x42B2, 0x42E2};

// Chunk c of a group's nibble layout -> two vectors of 16 bfloat16 pairs, 128 + q each: (q[4c], q[4c + 1]),
// (q[4c + 2], q[4c + 3]); with HB high bits (5-, 6-bit q) from the group's high-bit plane (quant_gemm.h)
template <int HB, int G, bool LEVELS = false>
inline void unpack_nibbles(const uint8_t* group, int c, vuint& low, vuint& high) {
  // lane j: byte 2j | byte 2j+1 << 16. One vpmovzxbw: GCC's own widening of a byte vector took five
  // instructions (two halves, an extract and an insert), and at few rows the unpack competes with the products
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * 32)));
  const __m512i nibble = _mm512_set1_epi32(0x000F000F), bf16_128 = _mm512_set1_epi32(0x43004300);
  if constexpr (HB == 0 && !LEVELS) {  // (w & nibble) | 128.0 in one vpternlogd each (0xEA: a & b | c)
    low = bitcast<vuint>(_mm512_ternarylogic_epi32(w, nibble, bf16_128, 0xEA));
    high = bitcast<vuint>(_mm512_ternarylogic_epi32(_mm512_srli_epi32(w, 4), nibble, bf16_128, 0xEA));
    return;
  }
  low = bitcast<vuint>(w & nibble);
  high = bitcast<vuint>(_mm512_srli_epi32(w, 4) & nibble);
  if constexpr (HB > 0) {
    const uint8_t* row = group + nibble_bytes(G) + high_row(HB, c) * TILE;
    const vuint h = bitcast<vuint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    add_high<HB>(h >> high_shift(HB, c), low, high);
  }
  if constexpr (LEVELS) {  // q indexes IQ4_LEVELS: their bfloat16 bits, one vpermw a vector (exact: |level| < 256)
    const __m512i table = _mm512_loadu_si512(IQ4_BF16);
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
  d = w.group_scale(t, g, 0);
  offset = WITH_128 ? w.group_min(t, g, 0) - 128.0f * d : vfloat{};
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

// BITS 4 to 6: the nibble layouts, with a minimum; 8: bytes, without (quant_gemm.h's dispatch); groups of G
// SUPERS: the scales are int8 sub-scales times a super-block's (K-quants, IQ4_XS), read a super-block at a time
template <int BITS, int G, bool MIN, bool SUPERS>
struct Bf16Kernel {
  static constexpr bool NIB = BITS < 8;
  static constexpr int HB = NIB ? BITS - 4 : 0;  // high bits above the nibble
  static constexpr bool LEVELS = NIB && !MIN;  // IQ4: q indexes IQ4_LEVELS; else 128 + q, the minimum's offset
                                              // taking the 128 back
  static constexpr int VECS = G / 2;  // pair vectors per group: vector v holds the 16 lanes' weights k = 2v, 2v + 1
  static constexpr bool TWO_CHAINS = G == 32;  // a group's products in two chains (rows, below)
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // one tile at a time; past two blocks of rows, unpacked once (measured: up to two, unpacking in each block
  // is faster than storing the unpacked tile and reading it back). Plain nibbles (no high bits, no levels)
  // unpack in four instructions a chunk, three of them off the products' pipes: up to four blocks (a 32-stream
  // decode step) they stay packed (1 thread, gate_up 3072 x 576 at 32 rows: 620 us packed, 641 unpacked; at 128
  // rows, even)
  static constexpr int PACKED_BLOCKS = NIB && HB == 0 && !LEVELS ? 4 : 2;
  Plan plan(int64_t M) const { return {MAX_ROWS, 1, M > PACKED_BLOCKS * MAX_ROWS}; }
  static constexpr int MAX_ROWS = ::MAX_ROWS, MAX_TILES = 1;
  using Unpacked = vuint;
  static constexpr int UNPACKED = VECS + 2;  // per group: its pair vectors, then d and the offset (float32)

  const Packed& w;
  const uint32_t* x;  // [M, K / 2] bfloat16 pairs
  const float* xsum;  // [M, K / G] (with a minimum)

  void unpack(int64_t t, vuint* out) const {
    const uint8_t* wt = w.tile(t);
    for (int64_t g = 0; g < w.groups(); ++g) {
      const uint8_t* wg = wt + g * GROUP_BYTES;
      vuint* o = out + g * UNPACKED;
      for (int c = 0; c < (NIB ? G / 4 : VECS); ++c) {
        if constexpr (NIB)
          unpack_nibbles<HB, G, LEVELS>(wg, c, o[2 * c], o[2 * c + 1]);
        else
          o[c] = unpack_q8(wg + c * 32);
      }
      vfloat d, offset;
      group_scales<MIN>(w, t, g, d, offset);
      o[VECS] = bitcast<vuint>(d);
      o[VECS + 1] = bitcast<vuint>(offset);
    }
  }

  // With next set, each group asks for a later tile's matching bytes ahead (quant_gemm.h, PREFETCH_STEPS): a
  // step reads its weights from memory (tens of MB), and the hardware's prefetcher alone stalls at each tile's
  // start (measured on the default model's GEMMs, cold: 1.10-1.24x at 1-8 rows, 1.04x at 32-64).
  template <int R>
  void rows(int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next, float* out) const {
    const uint8_t* wt = w.tile(t);
    const int64_t groups = w.groups();
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * (w.K / 2);
    vfloat y[R];  // local, so that the compiler keeps it in registers
    for (int r = 0; r < R; ++r) y[r] = vfloat{};
    vfloat super_d{}, super_m{};  // the current super-block's (SUPERS)
    for (int64_t g = 0; g < groups; ++g) {
      // Groups of 32: two chains of products a row, the group's even pair vectors (a chunk's low: v = 2c) and
      // its odd ones, added at the group's end (TWO_CHAINS). One chain waited on each product's latency (6 cycles
      // on Zen 4, where one issues a cycle): a model of this loop, 1 thread, 3072 x 576 at 1 row: 36 us with two
      // chains, 42 with one (2.4 and 2.8 cycles a product).
      // Groups of 16 (Q6_K) keep one chain in `even`: 8 products a group, and their heavier unpack, wait less,
      // and a second set of accumulators spilled at 8 rows (1 thread, 8192 x 2048 at 8 rows: 1747 us with one
      // chain, 1965 with two).
      vfloat even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = vfloat{};
      const int64_t k0 = g * VECS;  // the group's first bfloat16 pair
      if (next)
        for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + g * GROUP_BYTES + i);
      // pair vectors v and v + 1 of the group (v even)
      auto dot_rows = [&](vuint pairs_even, vuint pairs_odd, int64_t v) {
        for (int r = 0; r < R; ++r) even[r] = dot_pairs(even[r], pairs_even, xr[r][k0 + v]);
        if constexpr (TWO_CHAINS)
          for (int r = 0; r < R; ++r) odd[r] = dot_pairs(odd[r], pairs_odd, xr[r][k0 + v + 1]);
        else
          for (int r = 0; r < R; ++r) even[r] = dot_pairs(even[r], pairs_odd, xr[r][k0 + v + 1]);
      };
      vfloat d, offset;
      if (unpacked) {
        const vuint* u = unpacked + g * UNPACKED;
        for (int v = 0; v < VECS; v += 2) dot_rows(u[v], u[v + 1], v);
        d = bitcast<vfloat>(u[VECS]);
        offset = bitcast<vfloat>(u[VECS + 1]);
      } else {
        const uint8_t* wg = wt + g * GROUP_BYTES;
        if constexpr (NIB) {
          for (int c = 0; c < G / 4; ++c) {
            vuint low, high;
            unpack_nibbles<HB, G, LEVELS>(wg, c, low, high);
            dot_rows(low, high, 2 * c);
          }
        } else {
          for (int c = 0; c < VECS; c += 2) dot_rows(unpack_q8(wg + c * 32), unpack_q8(wg + c * 32 + 32), c);
        }
        if constexpr (SUPERS) {  // Packed::group_scale's products, the super-block's read once for its groups
          if (g % (SUPER / G) == 0) {
            const int64_t at = (t * w.supers() + g / (SUPER / G)) * TILE;
            super_d = load_halves(w.super_d + at);
            if constexpr (MIN) super_m = load_halves(w.super_m + at);
          }
          const int64_t at = (t * groups + g) * TILE;
          d = load_bytes(w.sub + at) * super_d;
          offset = MIN ? load_bytes(w.sub_min + at) * super_m - 128.0f * d : vfloat{};
        } else {
          group_scales<MIN>(w, t, g, d, offset);
        }
      }
      for (int r = 0; r < R; ++r) y[r] += (TWO_CHAINS ? even[r] + odd[r] : even[r]) * d;
      if constexpr (MIN)
        for (int r = 0; r < R; ++r) y[r] += offset * xsum[(m0 + r) * groups + g];
    }
    for (int r = 0; r < R; ++r) __builtin_memcpy(out + r * TILE, &y[r], sizeof(y[r]));
  }

  void rows(int R, int /* one tile */, int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next,
            float* out) const {
    switch (R) {
#define ROWS(n) \
  case n: return rows<n>(t, m0, unpacked, next, out);
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  }
};

void gemm(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(x);
  dispatch(w, [&](auto bits, auto g, auto min) {
    // each row's sum over each group (the minimum's term): once per row of x, for every output row
    std::vector<float> xsum(min() ? M * w.groups() : 0);
    if constexpr (min())
      at::parallel_for(0, M * w.groups(), 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) xsum[i] = group_sum<g()>(x + i * g());
      });
    if (w.sub)
      run_tiles(Bf16Kernel<bits(), g(), min(), true>{w, pairs, xsum.data()}, w, M, out);
    else
      run_tiles(Bf16Kernel<bits(), g(), min(), false>{w, pairs, xsum.data()}, w, M, out);
  });
}

}  // namespace

void gemm_bf16(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out) { gemm(w, x, M, out); }

#endif
