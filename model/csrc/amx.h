// AMX's tile state, shared by the kernels that run on tiles (the amx tier only: quant_gemm_amx.cpp,
// paged_attention_amx.cpp), and the tile instructions the attention runs, two ways: as instructions
// (HardwareTiles) or as a software model of them (EmulatedTiles), so that the same kernel is tested on any CPU
// that runs the amx tier's other code (AVX-512 BF16: tests/model/test_attention_tiles.py), slowly.
#pragma once

#if defined(__AMX_TILE__)

#include <ATen/core/Tensor.h>  // TORCH_CHECK
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

// LDTILECFG's 64 bytes, palette 1: per tile register its rows and bytes a row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's own LDTILECFG intrinsic tells the compiler that it reads 8 of its 64 bytes, so it may drop or delay
// the stores it reads (seen: a configuration half written, then #UD at the first tile load). This says what it
// reads.
inline void load_tile_config(const TileConfig& config) { asm volatile("ldtilecfg %0" : : "m"(config)); }

// Linux hands out the tile state (8 KiB per thread) only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); model/cpu_tier.py asks before choosing this tier, and this asks
// again for a module loaded without it. Once per process, for all its threads.
inline void require_tiles() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  TORCH_CHECK(granted, "the kernel refused this process AMX's tile state: run another CPU tier");
}

#if defined(__AMX_BF16__)

// Tile instructions on the tile registers, numbered at compile time as the instructions need. GCC 12's
// intrinsics paste their register numbers in as text (a template's parameter cannot be one) and say that a
// load or store touches no memory; these name the register by its value ("%c") and clobber memory.
struct HardwareTiles {
  static void configure(const TileConfig& config) {
    require_tiles();
    load_tile_config(config);
  }
  static void release() { _tile_release(); }
  template <int T>
  static void zero() {
    asm volatile("tilezero %%tmm%c0" : : "i"(T));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(static_cast<long>(stride)), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(static_cast<long>(stride)), "i"(T) : "memory");
  }
  // C += A B: A's rows of bfloat16 pairs times B's rows of pairs (B[r][2n + i] multiplies A[m][2r + i])
  template <int C, int A, int B>
  static void dpbf16ps() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "i"(C), "i"(A), "i"(B));
  }
};

// The same instructions on eight 1 KiB registers in memory, per thread, checking what the CPU would fault on
// (an unconfigured tile, shapes that do not fit each other). TDPBF16PS's sums are modelled in double, rounded
// once into C: the instruction's own sum is wider than float32 and matches no order of float32 operations
// (docs/performance-history.md), so the model's numbers are close to the hardware's, not its bits.
struct EmulatedTiles {
  struct Registers {
    TileConfig config;
    bool configured = false;
    alignas(64) uint8_t tile[8][16][64];
  };
  static Registers& registers() {
    thread_local Registers r;
    return r;
  }
  static void check(int t) {
    const Registers& r = registers();
    TORCH_CHECK(r.configured && r.config.rows[t] > 0 && r.config.rows[t] <= 16 && r.config.colsb[t] > 0 &&
                    r.config.colsb[t] <= 64,
                "tile ", t, " is not configured");
  }
  static void configure(const TileConfig& config) {
    Registers& r = registers();
    TORCH_CHECK(config.palette == 1, "palette 1 only");
    r.config = config;
    r.configured = true;
    std::memset(r.tile, 0, sizeof(r.tile));
  }
  static void release() { registers().configured = false; }
  template <int T>
  static void zero() {
    check(T);
    std::memset(registers().tile[T], 0, sizeof(registers().tile[T]));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    check(T);
    Registers& r = registers();
    std::memset(r.tile[T], 0, sizeof(r.tile[T]));
    for (int m = 0; m < r.config.rows[T]; ++m)
      std::memcpy(r.tile[T][m], static_cast<const uint8_t*>(base) + m * stride, r.config.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    check(T);
    const Registers& r = registers();
    for (int m = 0; m < r.config.rows[T]; ++m)
      std::memcpy(static_cast<uint8_t*>(base) + m * stride, r.tile[T][m], r.config.colsb[T]);
  }
  template <int C, int A, int B>
  static void dpbf16ps() {
    static_assert(C != A && C != B && A != B, "three distinct tiles");
    check(C), check(A), check(B);
    Registers& r = registers();
    const TileConfig& c = r.config;
    TORCH_CHECK(c.rows[C] == c.rows[A] && c.colsb[A] == 4 * c.rows[B] && c.colsb[C] == c.colsb[B] &&
                    c.colsb[C] % 4 == 0,
                "TDPBF16PS: the tiles' shapes do not fit");
    auto bf16 = [](const uint8_t* p) {
      uint32_t bits = uint32_t(p[0] | p[1] << 8) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return double(f);
    };
    for (int m = 0; m < c.rows[C]; ++m)
      for (int n = 0; n < c.colsb[C] / 4; ++n) {
        double sum = 0;
        for (int k = 0; k < c.rows[B]; ++k)
          for (int i = 0; i < 2; ++i) sum += bf16(&r.tile[A][m][4 * k + 2 * i]) * bf16(&r.tile[B][k][4 * n + 2 * i]);
        float out;
        std::memcpy(&out, &r.tile[C][m][4 * n], 4);
        out = static_cast<float>(double(out) + sum);
        std::memcpy(&r.tile[C][m][4 * n], &out, 4);
      }
  }
};

#endif  // __AMX_BF16__
#endif  // __AMX_TILE__
