// GEMMs on quantized weights (CPU): y = x W^T (+ bias), W in groups of 32 (or 16) weights along K, each group
// stored as small integers q with a scale d (and a minimum m), w = d q + m:
//   4-bit (GGUF Q4_0, Q4_1, Q4_K, int4 at load), 5-bit (Q5_0, Q5_1, Q5_K), 6-bit (Q6_K, groups of 16): q in
//          0 .. 2^bits - 1, with a minimum (Q5_0's d (q - 16) is d q + (-16 d), Q6_K's likewise with 32)
//   4-bit without a minimum (IQ4_NL, IQ4_XS, MXFP4): w = d levels[q], the format's 16 whole numbers (IQ4's
//          -127..113, MXFP4's -12..12: exact in bfloat16 and int16; quant_gemm.h)
//   8-bit (GGUF Q8_0, int8 at load): q in -128..127, no minimum
// d and m are float16 per group, or (K-quants, IQ4_XS) an int8 sub-scale per group times a float16 scale per
// super-block of 256: exact float32 products either way (quant_gemm.h, Packed). A group's sum runs on the exact
// integers, sum_k x_k q_k in float32, then times d (plus m * sum_k x_k, the sum of x per group computed once per
// row of x for every output): nothing is rounded to a 16-bit weight. The kernels, by what the CPU multiplies
// natively (model/cpu_tier.py): bfloat16 activations on AVX512-BF16 without AMX (quant_gemm_bf16.cpp; or, where
// a GEMM asks for it, rounded to int8 per group of 32 with VNNI: quant_gemm_i8.cpp); float32 ones as int16 per
// group of 32 with AVX2 (quant_gemm_i16.cpp; many rows on AMX's int8 tiles where the CPU has them, with the same
// integer sums: quant_gemm_amx.cpp), as they are elsewhere (quant_gemm_f32.cpp). bfloat16 ones are widened to
// float32 first where the CPU has no bfloat16 arithmetic, or has AMX.
//
// Layout (model/quant.py packs it): output rows in tiles of 16 (one vector lane each), K in groups:
//   4-bit: [tiles, groups, group / 4 chunks, 32 bytes]; chunk c, byte 2j + i holds lane j's q[4c + i] (low
//          nibble) and q[4c + 2 + i] (high nibble)
//   5-, 6-bit: the same nibbles, then each group's high bits (quant_gemm.h: nibble_bytes, add_high)
//   8-bit: [tiles, groups, group / 2 chunks, 32 bytes]; chunk c, byte 2j + i holds lane j's q[2c + i]
//   scales (d), mins (m): [tiles, groups, 16] float16; or int8 sub-scales and sub-minimums [tiles, groups, 16]
//   with supers (d) and super_mins (m) [tiles, K / 256, 16] float16; Q4_K's and Q5_K's 6-bit ones in the file's
//   12 bits a group: scales [tiles, groups, 16] bytes of the low bits, mins [tiles, K / 256, 16] int32 words of
//   the high bits (quant_gemm.h, ScaleForm)
// A fused layer whose parts come in several formats holds one segment per run of parts, each writing its own
// columns of the output. Every row of x runs the same instructions in the same order whatever the batch, so a
// token's output has the same bits alone or in any batch (no padding needed).

#include "quant_gemm.h"

#include "layer_stack.h"

namespace {

// The segment's tensors as the kernels read them, checked against its format and K
Packed packed_of(const QuantSegment& s, int64_t K, const float* bias) {
  // the kernels' forms (quant_gemm.h, dispatch)
  TORCH_CHECK((s.bits == 4 && s.group == 32) || (s.bits == 5 && s.group == 32 && s.mins) ||
                  (s.bits == 6 && s.group == 16 && s.mins) || (s.bits == 8 && s.group == 32 && !s.mins),
              "a quantized form no kernel runs: 4 bits in groups of 32 (with a minimum, or IQ4's levels), 5 bits in "
              "groups of 32 or 6 in groups of 16 with minimums, 8 in groups of 32 without");
  TORCH_CHECK(K % s.group == 0, "K must be a multiple of the group");
  TORCH_CHECK(s.group != Q6_K_GROUP || (s.supers && s.mins && s.mins->is_same(s.scales)),
              "groups of 16 are Q6_K's: int8 sub-scales that are their own sub-minimums, super-blocks of 256");
  const int64_t tiles = (s.n + TILE - 1) / TILE, groups = K / s.group;
  TORCH_CHECK(s.packed.scalar_type() == at::kByte && s.packed.is_contiguous() &&
                  s.packed.numel() == tiles * groups * TILE * s.group * s.bits / 8,
              "packed weights mismatch");
  const bool super = s.supers.has_value();
  const auto scale_type = super ? at::kChar : at::kHalf;
  TORCH_CHECK(s.scales.scalar_type() == scale_type && s.scales.is_contiguous() &&
                  s.scales.numel() == tiles * groups * TILE,
              "scales mismatch");
  // Q4_K's and Q5_K's 6-bit sub-scales and sub-minimums: the low bits' bytes in scales, the high bits' words
  // in mins (quant_gemm.h, SIX_BIT_SUBS)
  const bool six_bit = super && s.mins && s.mins->scalar_type() == at::kInt;
  if (six_bit) {
    TORCH_CHECK(s.mins->is_contiguous() && s.mins->numel() == tiles * (K / SUPER) * TILE && s.group == GROUP &&
                    (s.bits == 4 || s.bits == 5),
                "6-bit sub-scales mismatch");
  } else if (s.mins) {
    TORCH_CHECK(s.mins->scalar_type() == scale_type && s.mins->is_contiguous() && s.mins->numel() == s.scales.numel(),
                "mins mismatch");
  }
  if (super) {
    TORCH_CHECK(K % SUPER == 0, "super-blocks: K must be a multiple of 256");
    TORCH_CHECK(s.supers->scalar_type() == at::kHalf && s.supers->is_contiguous() &&
                    s.supers->numel() == tiles * (K / SUPER) * TILE,
                "supers mismatch");
    TORCH_CHECK(!s.mins || (s.super_mins && s.super_mins->scalar_type() == at::kHalf &&
                            s.super_mins->is_contiguous() && s.super_mins->numel() == s.supers->numel()),
                "super_mins mismatch");
  }
  Packed w{};
  w.bits = static_cast<int>(s.bits);
  w.group = static_cast<int>(s.group);
  w.has_min = s.mins.has_value();
  w.K = K;
  w.N = s.n;
  w.w = s.packed.data_ptr<uint8_t>();
  if (super) {
    w.sub = s.scales.data_ptr<int8_t>();
    if (six_bit)
      w.sub_high = reinterpret_cast<const uint32_t*>(s.mins->data_ptr<int32_t>());
    else
      w.sub_min = s.mins ? s.mins->data_ptr<int8_t>() : nullptr;
    w.super_d = s.supers->data_ptr<at::Half>();
    w.super_m = s.mins ? s.super_mins->data_ptr<at::Half>() : nullptr;
  } else {
    w.scale = s.scales.data_ptr<at::Half>();
    w.min = s.mins ? s.mins->data_ptr<at::Half>() : nullptr;
  }
  w.bias = bias;
  w.levels = IQ4_LEVELS;
  if (s.levels) {
    TORCH_CHECK(s.bits == 4 && !s.mins && s.levels->scalar_type() == at::kChar && s.levels->numel() == 16 &&
                    s.levels->is_contiguous(),
                "levels: int8 [16], for 4 bits without a minimum");
    w.levels = s.levels->data_ptr<int8_t>();
  }
  w.num_groups = K / s.group;
  return w;
}

}  // namespace

// x [M, K] bfloat16 or float32, checked; the bias as float32 (undefined without one)
static at::Tensor checked_bias(const at::Tensor& x, const QuantGemm& gemm) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be [M, K] bfloat16 or float32");
  TORCH_CHECK(x.size(1) % GROUP == 0, "K must be a multiple of 32");
  at::Tensor b;
  if (gemm.bias) {
    b = gemm.bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == gemm.n, "bias mismatch");
  }
  return b;
}

// gemm_into(w, o) for each of gemm's segments: its weights (with its part of the bias b) and the columns of out
// ([M, N] contiguous, float32 or bfloat16) it writes
template <typename F>
static void each_segment(const QuantGemm& gemm, int64_t K, const at::Tensor& b, const at::Tensor& out, F&& gemm_into) {
  const bool out_f32 = out.scalar_type() == at::kFloat;
  int64_t n0 = 0;
  for (const QuantSegment& s : gemm.segments) {
    TORCH_CHECK(n0 + s.n <= gemm.n, "segments wider than the output");
    gemm_into(packed_of(s, K, b.defined() ? b.data_ptr<float>() + n0 : nullptr),
              Output{out_f32 ? out.data_ptr<float>() + n0 : nullptr,
                     out_f32 ? nullptr : reinterpret_cast<c10::BFloat16*>(out.data_ptr()) + n0, gemm.n});
    n0 += s.n;
  }
  TORCH_CHECK(n0 == gemm.n, "segments narrower than the output");
}

// x W^T (+ b) into out ([M, N] contiguous, float32 or bfloat16): each segment's GEMM into its columns
static void exact_into(at::Tensor x, const QuantGemm& gemm, const at::Tensor& b, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1);
#if defined(__AVX512BF16__) && !defined(__AMX_INT8__)
  const bool bf16 = x.scalar_type() == at::kBFloat16;
#else  // widened: with AMX, int16 on its tiles beats bfloat16 pairs on vectors (~2.5x at 512 rows)
  const bool bf16 = false;
#endif
  x = bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();  // exact from bfloat16
#if defined(INT8_ACTIVATIONS)
  // x rounded to int8 where the GEMM asks for it (EngineConfig.gemm_activations), once for every segment:
  // bfloat16 x with VNNI (float32 models there keep int16), any with AVX2 alone
#if defined(__AVX512F__)
  const bool int8 = bf16 && gemm.int8;
#else
  const bool int8 = gemm.int8;
#endif
  Int8Activations x8;
  if (int8)
    x8 = bf16 ? round_activations(reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), M, K)
              : round_activations(x.data_ptr<float>(), M, K);
#endif
  each_segment(gemm, K, b, out, [&](const Packed& w, const Output& o) {
#if defined(INT8_ACTIVATIONS)
    if (int8) return gemm_i8(w, x8, M, o);
#endif
#if defined(__AVX512BF16__)
    if (bf16) return gemm_bf16(w, reinterpret_cast<const c10::BFloat16*>(x.data_ptr()), M, o);
#endif
#if defined(__AVX2__)
    gemm_i16(w, x.data_ptr<float>(), M, o);
#else
    gemm_f32(w, x.data_ptr<float>(), M, o);
#endif
  });
}

// x [M, K] bfloat16 or float32 -> [M, N] of x's dtype (float32 with float_out)
at::Tensor quant_gemm(at::Tensor x, const QuantGemm& gemm, bool float_out) {
  const auto b = checked_bias(x, gemm);
  // float32 out for the logits, else x's own dtype
  const bool out_f32 = float_out || x.scalar_type() == at::kFloat;
  auto out = at::empty({x.size(0), gemm.n}, x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  exact_into(x, gemm, b, out);
  return out;
}

// x [M, K] -> out [M, N]: x rounded to bfloat16 and the weights dequantized to bfloat16 (w = d q + m in float32,
// then rounded), multiplied on AMX's tiles with float32 sums. Not the exact weights of quant_gemm: the engine
// gives it a prompt's rows only, every prompt row always (quant_gemm_rows), so that a token's bits still depend
// on nothing but its own inputs and whether it is a prompt's.
static void dequantized_into(const at::Tensor& x, const QuantGemm& gemm, const at::Tensor& b, const at::Tensor& out) {
#if defined(__AMX_BF16__)
  const int64_t M = x.size(0), K = x.size(1);
  // A's tiles read 32 rows at a time: x itself where it has whole blocks of bfloat16 rows, else a copy with
  // zero rows past M
  const int64_t padded = (M + 31) / 32 * 32;
  at::Tensor xb = x;
  if (x.scalar_type() != at::kBFloat16 || !x.is_contiguous() || padded != M) {
    xb = at::empty({padded, K}, x.options().dtype(at::kBFloat16));
    const at::Tensor xc = x.contiguous();
    auto* dst = reinterpret_cast<uint16_t*>(xb.data_ptr());
    // rows rounded to nearest even by VCVTNE2PS2BF16 (torch's copy_ took ~4% of a prefill), zeros past M
    at::parallel_for(0, padded, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        uint16_t* row = dst + r * K;
        if (r >= M) {
          std::memset(row, 0, K * sizeof(uint16_t));
        } else if (xc.scalar_type() == at::kBFloat16) {
          std::memcpy(row, reinterpret_cast<const uint16_t*>(xc.data_ptr()) + r * K, K * sizeof(uint16_t));
        } else {
          const float* src = xc.data_ptr<float>() + r * K;
          for (int64_t k = 0; k < K; k += 32) {
            const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
            _mm512_storeu_si512(row + k, reinterpret_cast<__m512i>(pair));
          }
        }
      }
    });
  }
  each_segment(gemm, K, b, out, [&](const Packed& w, const Output& o) {
    gemm_amx_bf16(w, reinterpret_cast<const c10::BFloat16*>(xb.data_ptr()), M, o);
  });
#else
  (void)x, (void)gemm, (void)b, (void)out;
  TORCH_CHECK(false, "the dequantized GEMM runs on AMX's bfloat16 tiles: the amx tier only");
#endif
}

// x [M, K] bfloat16 or float32 -> [M, N] of x's dtype, on the dequantized weights (dequantized_into)
at::Tensor quant_gemm_dequantized(at::Tensor x, const QuantGemm& gemm) {
  const auto b = checked_bias(x, gemm);
  auto out = at::empty({x.size(0), gemm.n}, x.options());
  dequantized_into(x, gemm, b, out);
  return out;
}

// x [M, K] -> [M, N] of x's dtype: the rows in prompt_runs ([R, 2] int64, each a run [start, end) of prompt
// rows, in order) on the dequantized weights, the others on the exact ones, each part straight into its rows
std::vector<char> prompt_rows(const std::optional<at::Tensor>& prompt_runs, int64_t T) {
  std::vector<char> rows;
  if (!prompt_runs) return rows;
  TORCH_CHECK(prompt_runs->scalar_type() == at::kLong && prompt_runs->dim() == 2 && prompt_runs->size(1) == 2,
              "prompt_runs must be [R, 2] int64");
  rows.assign(T, 0);
  const auto runs = prompt_runs->contiguous();
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i) {
    TORCH_CHECK(0 <= r[2 * i] && r[2 * i] <= r[2 * i + 1] && r[2 * i + 1] <= T, "prompt_runs outside the step's rows");
    std::fill(rows.begin() + r[2 * i], rows.begin() + r[2 * i + 1], 1);
  }
  return rows;
}

at::Tensor quant_gemm_rows(at::Tensor x, const QuantGemm& gemm, const at::Tensor& prompt_runs) {
  const auto b = checked_bias(x, gemm);
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = at::empty({M, gemm.n}, x.options());
  TORCH_CHECK(prompt_runs.scalar_type() == at::kLong && prompt_runs.dim() == 2 && prompt_runs.size(1) == 2,
              "prompt_runs must be [R, 2] int64");
  const auto runs = prompt_runs.contiguous();
  const int64_t* r = runs.data_ptr<int64_t>();
  int64_t done = 0;  // rows computed so far
  for (int64_t i = 0; i <= runs.size(0); ++i) {
    const int64_t start = i < runs.size(0) ? r[2 * i] : M, end = i < runs.size(0) ? r[2 * i + 1] : M;
    TORCH_CHECK(done <= start && start <= end && end <= M, "prompt_runs must be ordered runs of x's rows");
    if (start > done) exact_into(x.narrow(0, done, start - done), gemm, b, out.narrow(0, done, start - done));
    if (end > start) dequantized_into(x.narrow(0, start, end - start), gemm, b, out.narrow(0, start, end - start));
    done = end;
  }
  return out;
}

at::Tensor QuantGemm::operator()(const at::Tensor& x) const { return quant_gemm(x, *this, false); }

// rows ids of the dequantized weight, float32 [n, K]: the exact values, w = d q + m with d q rounded first
at::Tensor quant_rows(const QuantGemm& gemm, at::Tensor ids, int64_t K) {
  ids = ids.to(at::kLong).contiguous();
  std::vector<Packed> parts;
  std::vector<int64_t> starts;
  int64_t n0 = 0;
  for (const QuantSegment& s : gemm.segments) {
    parts.push_back(packed_of(s, K, nullptr));
    starts.push_back(n0);
    n0 += s.n;
  }
  const int64_t n = ids.numel();
  auto out = at::empty({n, K}, ids.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n0, "row id out of range");
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      size_t p = 0;
      while (p + 1 < parts.size() && ip[r] >= starts[p + 1]) ++p;
      const Packed& w = parts[p];
      const int64_t row = ip[r] - starts[p], t = row / TILE, j = row % TILE, G = w.group;
      for (int64_t g = 0; g < w.groups(); ++g) {
        const uint8_t* wg = w.tile(t) + g * w.group_bytes();
        // lane j's d and m: from the VL lanes holding it
        vfloat dv, mv;
        w.group_scales(t, g, static_cast<int>(j / VL), dv, mv);
        const float d = dv[j % VL], m = mv[j % VL];
        float* o = dst + r * K + g * G;
        for (int k = 0; k < G; ++k) {
          const int q = packed_q(wg, static_cast<int>(G), w.bits, static_cast<int>(j), k);
          if (w.bits < 8 && !w.has_min)
            o[k] = static_cast<float>(w.levels[q]) * d;  // q indexes the format's levels
          else if (w.has_min)
            o[k] = static_cast<float>(q) * d + m;  // two roundings, as model/quant.py's
          else
            o[k] = static_cast<float>(q) * d;
        }
      }
    }
  });
  return out;
}
