// The quantized GEMM on AMX's int8 tiles (the amx tier), for GEMMs of many rows: the same integer sums as the
// int16 vector kernel (quant_gemm_i16.cpp), which runs the few rows, so that a row's bits are the same whichever
// of the two multiplies it.
//
// x arrives as quant_gemm_i16.cpp rounds it: per row and 32 activations, int16 xq with a step s. Each xq splits
// exactly into two bytes, xq = 256 xh + xl (xh signed, xl unsigned), so a group's sum
//   sum_k xq_k q_k = 256 sum_k xh_k q_k + sum_k xl_k q_k
// is two tile products into int32, from zero, exact (|sum| < 2^31 as there): the integer vpmaddwd's sums give.
// Then, per group and in the same float32 operations in the same order as there, y += d (s sum), then
// + m (s sum_k xq_k) with a minimum. A tile's products pay for 16 rows whatever it holds, and a group's unpacking
// and sums cost the same at 1 row as at 16: at a decode step's few rows the vector kernel is ~2x faster (an
// MoE's experts, 1 row: 2.0 against 3.7 ms a layer), at a prompt's hundreds the tiles (2x at 32 rows an expert).
//
// A: per block of 16 rows of xq and group, the rows' high bytes, then their low ones ([tile_rows][G] each).
// B: per tile of 16 outputs and group, G / 4 rows of 64 bytes, each the 16 outputs' q for 4 consecutive k (AMX's
// quad layout), unpacked from the packed layout once per step (quant_gemm.cpp).
//
// The tiles are configured once per call and thread (LDTILECFG is per thread, and torch's oneDNN may have
// configured them otherwise in between) and released at the end, so that a thread's context switches do not
// save 8 KiB of tile data.

#include "quant_gemm.h"

#if defined(__AMX_INT8__)

#include <sys/syscall.h>
#include <unistd.h>

namespace {

static_assert(VL == TILE, "one 16-lane vector per tile");

// LDTILECFG's 64 bytes, palette 1: per tile register its rows and bytes a row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's own LDTILECFG and TILELOADD intrinsics tell the compiler that the first reads 8 of its 64 bytes and
// the second no memory at all, so it may drop or delay the stores they read (seen: a configuration half
// written, then #UD at the first tile load). These two say what they read.
inline void load_tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }
#define TILE_LOAD(tmm, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #tmm : : "r"(base), "r"(static_cast<long>(stride)) : "memory")

// The tile registers: a group's products for one block of rows (A: its high bytes, its low ones) by two tiles of
// outputs (B), each product's sums in its own C
enum Tile { C0H, C0L, C1H, C1L, AH, AL, B0, B1 };

// Linux hands out the tile state (8 KiB per thread) only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); model/cpu_tier.py asks before choosing this tier, and this asks
// again for a module loaded without it. Once per process, for all its threads.
void require_tiles() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  TORCH_CHECK(granted, "the kernel refused this process AMX's tile state: run another CPU tier");
}


inline __m512i widen_words(const uint8_t* p) {  // 16 words -> the low halves of 16 dwords
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int BITS, int G, bool MIN>
struct AmxKernel {
  static constexpr bool NIB = BITS < 8;
  static constexpr int HB = NIB ? BITS - 4 : 0;  // high bits above the nibble
  static constexpr bool LEVELS = NIB && !MIN;     // q indexes the format's levels (signed), as 8-bit q is
  static constexpr int QUADS = G / 4;             // B's rows a group
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // Blocks of 16 rows (A's), two tiles a step, unpacked once a step for all its blocks
  static constexpr int MAX_ROWS = TILE, MAX_TILES = 2;
  Plan plan(int64_t) const { return {TILE, MAX_TILES, true, true}; }
  using Unpacked = __m512i;
  static constexpr int UNPACKED = QUADS + 2;  // per group: B's rows, then d and m (float32)

  const Packed& w;
  const uint8_t* a;     // [blocks, groups, 2, tile_rows, G]: A's high bytes, then its low ones
  const float* step;    // [M, K / 32] s of each row's 32
  const float* xsum;    // [M, K / G] s sum_k xq_k of each row's group (with a minimum)
  int tile_rows;        // A's and C's rows: 16, or M where fewer
  int64_t group_a() const { return 2 * tile_rows * G; }  // bytes of one group's two A tiles

  struct ThreadScope {
    explicit ThreadScope(int rows) {
      TileConfig config;
      for (int t : {C0H, C0L, C1H, C1L}) config.rows[t] = rows, config.colsb[t] = TILE * sizeof(int32_t);
      for (int t : {AH, AL}) config.rows[t] = rows, config.colsb[t] = G;
      for (int t : {B0, B1}) config.rows[t] = QUADS, config.colsb[t] = TILE * 4;
      load_tile_config(config);
    }
    ~ThreadScope() { _tile_release(); }
    ThreadScope(const ThreadScope&) = delete;
  };
  ThreadScope thread_scope() const { return ThreadScope(tile_rows); }

  // Row c of a group's B: lane j's q[4c] .. q[4c + 3], a byte each (the packed layout: quant_gemm.cpp)
  static __m512i quads(const uint8_t* wg, int c, const int8_t* levels) {
    if constexpr (!NIB) {  // chunks 2c and 2c + 1: lane j's word (q[4c], q[4c + 1]), then (q[4c + 2], q[4c + 3])
      return _mm512_or_si512(widen_words(wg + 2 * c * 32), _mm512_slli_epi32(widen_words(wg + (2 * c + 1) * 32), 16));
    } else {
      // lane j: bytes 2j, 2j + 1 of chunk c at bits 0 and 16, then q[4c] | q[4c + 1] << 16 (low) and
      // q[4c + 2] | q[4c + 3] << 16 (high), the high bits added as quant_gemm.h says
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + c * 32)));
      const __m512i nibble = _mm512_set1_epi32(0x000F000F);
      vuint low = bitcast<vuint>(_mm512_and_si512(v, nibble));
      vuint high = bitcast<vuint>(_mm512_and_si512(_mm512_srli_epi32(v, 4), nibble));
      if constexpr (HB > 0) {
        const uint8_t* row = wg + nibble_bytes(G) + high_row(HB, c) * TILE;
        const vuint h = bitcast<vuint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
        add_high<HB>(h >> high_shift(HB, c), low, high);
      }
      // bytes q[4c], q[4c + 2], q[4c + 1], q[4c + 3] (each q < 64), then in k's order
      const __m512i mixed = bitcast<__m512i>(low | (high << 8));
      const __m512i order = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15));
      __m512i q = _mm512_shuffle_epi8(mixed, order);
      if constexpr (LEVELS)  // the levels in each 128-bit lane: vpshufb looks a byte up within its lane
        q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels))), q);
      return q;
    }
  }

  void unpack(int64_t t, __m512i* out) const {
    const uint8_t* wt = w.tile(t);
    for (int64_t g = 0; g < w.groups(); ++g) {
      __m512i* o = out + g * UNPACKED;
      for (int c = 0; c < QUADS; ++c) o[c] = quads(wt + g * GROUP_BYTES, c, w.levels);
      vfloat d, m;
      w.group_scales(t, g, 0, d, m);
      o[QUADS] = bitcast<__m512i>(d);
      o[QUADS + 1] = bitcast<__m512i>(m);
    }
  }

  // One group's products, C = A B from zero: both parts of A by `tiles` B tiles, stored into c (16 x 16 int32
  // each: high, low, then the second tile's). q's sign picks the instruction: A's high bytes are signed, its low
  // ones unsigned; q is unsigned with a minimum (0 .. 2^bits - 1), else signed (8-bit, IQ4's levels)
  void products(int tiles, const uint8_t* ag, const __m512i* b0, const __m512i* b1, int32_t (*c)[TILE * TILE]) const {
    constexpr long b_stride = TILE * 4, c_stride = TILE * sizeof(int32_t);
    static_assert(C0H == 0 && C0L == 1 && C1H == 2 && C1L == 3 && AH == 4 && AL == 5 && B0 == 6 && B1 == 7);
    TILE_LOAD(6, b0, b_stride);
    if (tiles > 1) TILE_LOAD(7, b1, b_stride);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    TILE_LOAD(4, ag, G);
    TILE_LOAD(5, ag + tile_rows * G, G);
    if constexpr (MIN) {
      _tile_dpbsud(0, 4, 6);
      _tile_dpbuud(1, 5, 6);
      if (tiles > 1) {
        _tile_dpbsud(2, 4, 7);
        _tile_dpbuud(3, 5, 7);
      }
    } else {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbusd(1, 5, 6);
      if (tiles > 1) {
        _tile_dpbssd(2, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], c_stride);
    _tile_stored(1, c[1], c_stride);
    if (tiles > 1) {
      _tile_stored(2, c[2], c_stride);
      _tile_stored(3, c[3], c_stride);
    }
  }

  // Rows m0 .. m0 + R - 1 (one block: m0 a multiple of 16) of tiles t .. t + nt - 1 into y ([R][nt * 16])
  void rows(int R, int nt, int64_t t, int64_t m0, const __m512i* unpacked, const uint8_t* next, float* y) const {
    const int64_t groups = w.groups(), steps = w.K / GROUP, per_tile = groups * UNPACKED;
    const uint8_t* ab = a + m0 / TILE * groups * group_a();
    const int width = nt * TILE;
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < width; l += VL) _mm512_storeu_ps(y + r * width + l, _mm512_setzero_ps());
    alignas(64) int32_t c[4][TILE * TILE];
    for (int64_t g = 0; g < groups; ++g) {
      if (next)  // the next step's bytes, asked for ahead: see quant_gemm_bf16.cpp
        for (int j = 0; j < nt; ++j)
          for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + (j * groups + g) * GROUP_BYTES + i);
      const __m512i* u = unpacked + g * UNPACKED;
      products(nt, ab + g * group_a(), u, u + per_tile, c);
      for (int j = 0; j < nt; ++j) {
        const __m512i* uj = u + j * per_tile;
        const __m512 d = _mm512_castsi512_ps(uj[QUADS]), m = _mm512_castsi512_ps(uj[QUADS + 1]);
        for (int r = 0; r < R; ++r) {
          const __m512i high = _mm512_load_si512(c[2 * j] + r * TILE), low = _mm512_load_si512(c[2 * j + 1] + r * TILE);
          const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
          // y += d (s sum) (+ m s sum_k xq_k), as quant_gemm_i16.cpp's lanes compute it
          const __m512 s = _mm512_set1_ps(step[(m0 + r) * steps + g * G / GROUP]);
          float* yr = y + r * width + j * TILE;
          __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), s), d, _mm512_loadu_ps(yr));
          if constexpr (MIN) v = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(m0 + r) * groups + g]), v);
          _mm512_storeu_ps(yr, v);
        }
      }
    }
  }
};

}  // namespace

void gemm_amx(const Packed& w, const int16_t* xq, const float* step, const float* xsum, int64_t M,
              const Output& out) {
  require_tiles();
  const int tile_rows = static_cast<int>(std::min<int64_t>(M, TILE));
  const int64_t blocks = (M + TILE - 1) / TILE, K = w.K, per_block = 2 * tile_rows * K;  // bytes of a block's A
  // A's tiles in the calling thread's buffer, kept at its largest size (a 512-row x's are 2 MB for K = 2048)
  thread_local std::vector<__m512i> buffer;
  const size_t vectors = (blocks * per_block + 63) / 64;
  if (buffer.size() < vectors) buffer.resize(vectors);
  auto* a = reinterpret_cast<uint8_t*>(buffer.data());  // a pointer: in the region a thread_local is a worker's
  dispatch(w, [&](auto bits, auto g, auto min) {
    constexpr int G = g();
    const int64_t groups = K / G;
    at::parallel_for(0, blocks, blocks > 1 ? 1 : blocks + 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t gi = 0; gi < groups; ++gi)
          for (int r = 0; r < tile_rows; ++r) {
            uint8_t* high = a + b * per_block + gi * 2 * tile_rows * G + r * G;
            uint8_t* low = high + tile_rows * G;
            const int64_t row = b * TILE + r;
            if (row >= M) {  // the last block's rows past x: zeros, whose sums nobody reads
              std::memset(high, 0, G);
              std::memset(low, 0, G);
              continue;
            }
            const int16_t* src = xq + row * K + gi * G;
            for (int k = 0; k < G; k += 16) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(high + k), _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 8)));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(low + k), _mm256_cvtepi16_epi8(v));
            }
          }
    });
    run_tiles(AmxKernel<bits(), G, min()>{w, a, step, xsum, tile_rows}, w, M, out);
  });
}

#endif
