// The quantized GEMM for bfloat16 activations on CPUs with AMX (the amx tier): each group's products on tiles.
//
// A group of G weights along K is one tile product: A = 16 rows of x (the group's G bfloat16), B = the group's
// exact integers as bfloat16 pairs for a tile of 16 outputs (the unpacked form quant_gemm_bf16.h makes: vector
// v holds the 16 lanes' weights k = 2v, 2v + 1, which is AMX's pair layout as it is), C = the 16 x 16 sums
// sum_k x_k q_k, from zero. C goes to memory and each row of it is scaled as the AVX-512 kernel scales its
// group sums: y += C d, then y += offset * sum_k x_k (128 + q and IQ4's levels as there).
//
// TDPBF16PS sums a group's products in its own order and width (not float32 one product at a time: measured,
// neither VDPBF16PS's order nor any float32 sequence gives its bits), so this tier runs every batch size on
// tiles, a single row too: a row's bits depend only on its own x, never on the rows beside it in a tile, so a
// token's output has the same bits alone or in any batch, as on every tier.
//
// The tiles are configured once per call and thread (LDTILECFG is per thread, and torch's oneDNN may have
// configured them otherwise in between) and released at the end, so that a thread's context switches do not
// save 8 KiB of tile data.

#include "quant_gemm_bf16.h"

#if defined(__AMX_BF16__)

#include <mutex>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

using namespace bf16_groups;

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

// The tile registers: four C, so that a group's sums are scaled while the next three groups' products run
// (TDPBF16PS takes tens of cycles, and a tile's store reaches the loads that read it back only once it retires:
// two in flight ran at a quarter of the tiles' rate), and two pairs of A and B, alternating
constexpr int IN_FLIGHT = 4;
enum Tile { C0, C1, C2, C3, A0, B0, A1, B1 };

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

template <int BITS, int G, bool MIN>
struct AmxKernel {
  static constexpr int VECS = G / 2;  // pair vectors (B's rows) per group
  static constexpr int64_t GROUP_BYTES = TILE * G * BITS / 8;

  // a block is one A tile, 16 rows; a tile's weights are unpacked once where more than one block reads them,
  // else each group into a scratch tile as it comes (it stays in L1)
  static constexpr int MAX_ROWS = TILE, MAX_TILES = 1;
  Plan plan(int64_t M) const { return {MAX_ROWS, 1, M > MAX_ROWS, true}; }
  using Unpacked = vuint;
  static constexpr int UNPACKED = VECS + 2;  // per group: its pair vectors, then d and the offset (float32)

  const Packed& w;
  const c10::BFloat16* x;  // x's A tiles one after the other: [blocks, K / G, tile_rows, G] (a_tiles)
  const float* xsum;       // [M, K / G] (with a minimum)
  int64_t M;
  int tile_rows;  // A's and C's rows: 16, or M where fewer

  // Per thread, for the loop's duration (run_tiles): the tile configuration, then its release
  struct ThreadScope {
    explicit ThreadScope(int rows) {
      TileConfig config;
      for (int t : {C0, C1, C2, C3}) config.rows[t] = rows, config.colsb[t] = TILE * sizeof(float);
      for (int t : {A0, A1}) config.rows[t] = rows, config.colsb[t] = G * sizeof(c10::BFloat16);
      for (int t : {B0, B1}) config.rows[t] = VECS, config.colsb[t] = TILE * sizeof(uint32_t);
      load_tile_config(config);
    }
    ~ThreadScope() { _tile_release(); }
    ThreadScope(const ThreadScope&) = delete;
  };
  ThreadScope thread_scope() const { return ThreadScope(tile_rows); }

  void unpack(int64_t t, vuint* out) const {
    for (int64_t g = 0; g < w.groups(); ++g) unpack_group<BITS, G, MIN>(w, t, g, out + g * UNPACKED);
  }

  // C = A B into c (16 rows of 16 float32), on C tile I (A and B: pair I % 2): b the group's unpacked pair
  // vectors, a the A tile's first row of x at the group's first column
  template <int I>
  void product(const vuint* b, const c10::BFloat16* a, float* c) const {
    // GCC's tile intrinsics take their registers as literals (they are pasted into the assembly)
#define PRODUCT(C, A, B)                          \
  TILE_LOAD(B, b, TILE * sizeof(uint32_t));       \
  TILE_LOAD(A, a, G * sizeof(c10::BFloat16));    \
  _tile_zero(C);                                   \
  _tile_dpbf16ps(C, A, B);                         \
  _tile_stored(C, c, TILE * sizeof(float));
    static_assert(C0 == 0 && C3 == 3 && A0 == 4 && B0 == 5 && A1 == 6 && B1 == 7);
    if constexpr (I == 0) {
      PRODUCT(0, 4, 5)
    } else if constexpr (I == 1) {
      PRODUCT(1, 6, 7)
    } else if constexpr (I == 2) {
      PRODUCT(2, 4, 5)
    } else {
      PRODUCT(3, 6, 7)
    }
#undef PRODUCT
  }

  // Rows m0 .. m0 + R - 1: block m0 / 16, whose A tiles hold tile_rows rows of x from `first` (a_tiles), the
  // block's rows among them.
  //
  // Three stages run at once over the groups: a group is unpacked (unless the tile was, once, for all blocks)
  // UNPACK_AHEAD groups before its sums are scaled, its products issued IN_FLIGHT - 1 before. A tile load of
  // B right after the vector stores that wrote it waited for them (1 row: 43 ns a group, 17 with the unpack
  // three groups earlier; measured in isolation on the Xeon this tier was written on).
  static constexpr int UNPACK_AHEAD = 2 * IN_FLIGHT - 2, RING = 2 * IN_FLIGHT;
  template <int R>
  void rows(int64_t t, int64_t m0, const vuint* unpacked, const uint8_t* next, float* out) const {
    const int64_t first = std::min<int64_t>(m0, M - tile_rows), skip = m0 - first;
    const int64_t groups = w.groups();
    const c10::BFloat16* block = x + m0 / TILE * groups * tile_rows * G;
    alignas(64) vuint scratch[unpacked ? 1 : RING][UNPACKED];
    alignas(64) float c[IN_FLIGHT][TILE * TILE];
    auto group = [&](int64_t g) {  // group g's unpacked vectors
      return unpacked ? unpacked + g * UNPACKED : scratch[g % RING];
    };
    auto unpack = [&](int64_t g) {
      if (next)
        for (int64_t i = 0; i < GROUP_BYTES; i += 64) prefetch_l2(next + g * GROUP_BYTES + i);
      if (!unpacked) unpack_group<BITS, G, MIN>(w, t, g, scratch[g % RING]);
    };
    auto issue = [&](int64_t g) {  // group g's products, on C tile g % IN_FLIGHT
      const vuint* b = group(g);
      const c10::BFloat16* a = block + g * tile_rows * G;
      switch (g % IN_FLIGHT) {
        case 0: return product<0>(b, a, c[0]);
        case 1: return product<1>(b, a, c[1]);
        case 2: return product<2>(b, a, c[2]);
        default: return product<3>(b, a, c[3]);
      }
    };
    vfloat y[R];  // local, so that the compiler keeps it in registers
    for (int r = 0; r < R; ++r) y[r] = vfloat{};
    for (int64_t g = 0; g < std::min<int64_t>(UNPACK_AHEAD, groups); ++g) unpack(g);
    for (int64_t g = 0; g < std::min<int64_t>(IN_FLIGHT - 1, groups); ++g) issue(g);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + UNPACK_AHEAD < groups) unpack(g + UNPACK_AHEAD);
      if (g + IN_FLIGHT - 1 < groups) issue(g + IN_FLIGHT - 1);
      const vuint* u = group(g);
      const vfloat d = bitcast<vfloat>(u[VECS]), offset = bitcast<vfloat>(u[VECS + 1]);
      const float* cg = c[g % IN_FLIGHT] + skip * TILE;
      for (int r = 0; r < R; ++r) y[r] += load_floats(cg + r * TILE) * d;
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
      ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
    }
  }
};

// x [M, K] as its A tiles, one after the other: block b's tiles hold rows first .. first + tile_rows - 1 of
// x (first = 16 b, or M - 16 for a block that ends x: x has no rows past M to read), [groups, tile_rows, G]
// each, 1 KiB read at once. Read from x itself, 16 rows K * 2 bytes apart, the 512-row products of a
// 2,048-wide x ran at 16 ns a group (1 thread, 4096 x 2048 at 512 rows: 36 ms against 28 ms this way)
std::vector<c10::BFloat16> a_tiles(const c10::BFloat16* x, int64_t M, int64_t K, int G, int tile_rows) {
  const int64_t blocks = (M + TILE - 1) / TILE, groups = K / G;
  std::vector<c10::BFloat16> tiles(blocks * groups * tile_rows * G);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = std::min<int64_t>(b * TILE, M - tile_rows);
      c10::BFloat16* dst = tiles.data() + b * groups * tile_rows * G;
      for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < tile_rows; ++r) std::copy_n(x + (first + r) * K + g * G, G, dst + (g * tile_rows + r) * G);
    }
  });
  return tiles;
}

}  // namespace

void gemm_amx(const Packed& w, const c10::BFloat16* x, int64_t M, const Output& out) {
  require_tiles();
  const int tile_rows = static_cast<int>(std::min<int64_t>(M, TILE));
  dispatch(w, [&](auto bits, auto g, auto min) {
    const std::vector<float> xsum = min() ? group_sums<g()>(x, M, w.groups()) : std::vector<float>();
    const std::vector<c10::BFloat16> tiles = a_tiles(x, M, w.K, g(), tile_rows);
    run_tiles(AmxKernel<bits(), g(), min()>{w, tiles.data(), xsum.data(), M, tile_rows}, w, M, out);
  });
}

#endif
