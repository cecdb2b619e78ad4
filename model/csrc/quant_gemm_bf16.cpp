// The quantized GEMM for bfloat16 activations on CPUs with AVX512-BF16 (the avx512bf16 tier; elsewhere
// bfloat16 activations are widened to float32 and take quant_gemm_f32.cpp).
//
// The integers are exact in bfloat16, so a group's sum runs on the exact weights: sum_k x_k q_k, from bfloat16
// pair products (exact in float32, one vdpbf16ps per pair of k for 16 lanes; in groups of 32, two chains, the
// group's even and odd pair vectors, added at the group's end: the same order for every row in every path), then
// times d (plus m * sum_k x_k).
// A 4- to 6-bit q is turned into a bfloat16 by writing it into the mantissa of 128.0, which gives 128 + q; the
// 128 * sum_k x_k that adds is taken back with the offset m - 128 d.

#include "quant_gemm_bf16.h"

#if defined(__AVX512BF16__)

namespace {

using namespace bf16_groups;

constexpr int MAX_ROWS = 8;  // rows of x computed together (accumulators kept in registers)

// acc + the pairwise dot products of 16 lanes of bfloat16 pairs: w (packed weights) and x (one pair, the same
// in every lane)
inline vfloat dot_pairs(vfloat acc, vuint w, uint32_t x) {
  return bitcast<vfloat>(_mm512_dpbf16_ps(bitcast<__m512>(acc), bitcast<__m512bh>(w),
                                          bitcast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x)))));
}

// BITS 4 to 6: the nibble layouts, with a minimum; 8: bytes, without (quant_gemm.h's dispatch); groups of G
// FORM: the scales' ScaleForm (quant_gemm.h); a super-block's scales are read once for its groups
template <int BITS, int G, bool MIN, int FORM>
struct Bf16Kernel {
  static constexpr bool NIB = BITS < 8;
  static constexpr int HB = NIB ? BITS - 4 : 0;  // high bits above the nibble
  static constexpr bool LEVELS = NIB && !MIN;  // q indexes the format's levels; else 128 + q, the minimum's offset
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
    for (int64_t g = 0; g < w.groups(); ++g) unpack_group<BITS, G, MIN>(w, t, g, out + g * UNPACKED);
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
    [[maybe_unused]] SuperScales<FORM, MIN, G> supers;
    [[maybe_unused]] const __m512i table = LEVELS ? levels_bf16(w.levels) : __m512i{};
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
            unpack_nibbles<HB, G, LEVELS>(wg, c, low, high, table);
            dot_rows(low, high, 2 * c);
          }
        } else {
          for (int c = 0; c < VECS; c += 2) dot_rows(unpack_q8(wg + c * 32), unpack_q8(wg + c * 32 + 32), c);
        }
        if constexpr (FORM != HALF_SCALES) {
          vfloat m;
          supers.group(w, t, g, 0, d, m);
          offset = MIN ? m - 128.0f * d : vfloat{};
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
    const std::vector<float> xsum = min() ? group_sums<g()>(x, M, w.groups()) : std::vector<float>();
    dispatch_scales(w, [&](auto form) {
      if constexpr (form_of(form(), bits(), g(), min()))
        run_tiles(Bf16Kernel<bits(), g(), min(), form()>{w, pairs, xsum.data()}, w, M, out);
    });
  });
}

}  // namespace

void gemm_bf16(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out) { gemm(w, x, M, out); }

#endif
