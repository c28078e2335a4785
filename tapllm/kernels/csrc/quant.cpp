// Weight-only quantized linears: y = x W^T + b with W kept as 4- or 8-bit integers and
// per-group float32 scales, dequantized in registers (never into memory) for decode-sized
// row counts, and dequantized one column chunk at a time into a GEMM for prefill sizes.
//
// Layouts (tapllm/quant/schemes.py writes them; GGUF Q4_0/Q4_1/Q8_0 blocks map onto them):
//   bits 4: q uint8 [N, K/2]; in each run of 32 weights, byte j holds weight j (low nibble)
//           and weight j + 16 (high nibble), as GGUF's Q4_0/Q4_1 blocks do; w = scale * q + min.
//   bits 8: q int8 [N, K]; w = scale * q.
// scales (and mins) are float32 [N, K / group]; group is a multiple of 32 (4 bits) or 16 (8 bits).
//
// Arithmetic: each group's integer-weighted sum of x in float32, times the group's scale;
// for 4 bits plus min * (sum of x over the group). The result differs from x @ dequant(W)^T
// in float32 only by the order of the sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace tapllm {
namespace {

constexpr int64_t kMaxFusedRows = 16;  // more rows: dequantize a column chunk, then GEMM
constexpr int64_t kChunkCols = 1024;   // columns dequantized at once on the GEMM path

// ---- a few vector helpers, one width per instruction set ----------------------------------
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kW = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
// floats of bytes [part * 16, part * 16 + 16) of 16 unsigned / signed bytes
inline V u8_to_f(__m128i b, int) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline V i8_to_f(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kW = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V u8_to_f(__m128i b, int part) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part ? _mm_srli_si128(b, 8) : b));
}
inline V i8_to_f(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Rows of x widened to float32, and (4 bits) each row's sum over every group.
struct Rows {
  const float* x;   // [m, K]
  const float* xs;  // [m, G] or null
  int64_t k;
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// MR rows x NC columns [n, n + NC) of a 4-bit weight; out[r * ldo + c].
template <int MR, int NC>
inline void int4_tile(const Rows& rows, int64_t r0, const uint8_t* q, const float* sc, const float* mn,
                      int64_t group, int64_t n, float* out, int64_t ldo) {
  const int64_t k = rows.k, groups = k / group, qrow = k / 2;
  const __m128i low = _mm_set1_epi8(0x0F);
  V acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    V t0[MR][NC], t1[MR][NC];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NC; ++c) t0[r][c] = t1[r][c] = vzero();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
      for (int c = 0; c < NC; ++c) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (n + c) * qrow + k0 / 2));
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        for (int part = 0; part < 16 / kW; ++part) {
          const V wl = u8_to_f(lo, part), wh = u8_to_f(hi, part);
          for (int r = 0; r < MR; ++r) {
            const float* xr = rows.x + (r0 + r) * k + k0 + part * kW;
            t0[r][c] = vfma(wl, vload(xr), t0[r][c]);
            t1[r][c] = vfma(wh, vload(xr + 16), t1[r][c]);
          }
        }
      }
    }
    for (int c = 0; c < NC; ++c) {
      const V s = vset(sc[(n + c) * groups + g]);
      for (int r = 0; r < MR; ++r) acc[r][c] = vfma(s, vadd(t0[r][c], t1[r][c]), acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const float* xs = rows.xs + (r0 + r) * groups;
    for (int c = 0; c < NC; ++c) {
      const float* m = mn + (n + c) * groups;
      float bias = 0.f;
      for (int64_t g = 0; g < groups; ++g) bias += m[g] * xs[g];
      out[(r0 + r) * ldo + n + c] = vsum(acc[r][c]) + bias;
    }
  }
}

template <int MR, int NC>
inline void int8_tile(const Rows& rows, int64_t r0, const int8_t* q, const float* sc, int64_t group, int64_t n,
                      float* out, int64_t ldo) {
  const int64_t k = rows.k, groups = k / group;
  V acc[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    V t0[MR][NC], t1[MR][NC];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NC; ++c) t0[r][c] = t1[r][c] = vzero();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 16) {
      for (int c = 0; c < NC; ++c) {
        const int8_t* qc = q + (n + c) * k + k0;
        for (int part = 0; part < 16 / kW; ++part) {
          const V w = i8_to_f(qc + part * kW);
          for (int r = 0; r < MR; ++r) {
            const V xv = vload(rows.x + (r0 + r) * k + k0 + part * kW);
            if ((k0 / 16) & 1) t1[r][c] = vfma(w, xv, t1[r][c]);
            else t0[r][c] = vfma(w, xv, t0[r][c]);
          }
        }
      }
    }
    for (int c = 0; c < NC; ++c) {
      const V s = vset(sc[(n + c) * groups + g]);
      for (int r = 0; r < MR; ++r) acc[r][c] = vfma(s, vadd(t0[r][c], t1[r][c]), acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[(r0 + r) * ldo + n + c] = vsum(acc[r][c]);
}
#endif

// Scalar versions (the generic build, and the columns left over after the vector tiles).
inline void int4_scalar(const Rows& rows, int64_t r, const uint8_t* q, const float* sc, const float* mn,
                        int64_t group, int64_t n, float* out, int64_t ldo) {
  const int64_t k = rows.k, groups = k / group;
  const float* x = rows.x + r * k;
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float t = 0.f;
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
      const uint8_t* b = q + n * (k / 2) + k0 / 2;
      for (int j = 0; j < 16; ++j) t += (b[j] & 15) * x[k0 + j] + (b[j] >> 4) * x[k0 + 16 + j];
    }
    total += sc[n * groups + g] * t + mn[n * groups + g] * rows.xs[r * groups + g];
  }
  out[r * ldo + n] = total;
}

inline void int8_scalar(const Rows& rows, int64_t r, const int8_t* q, const float* sc, int64_t group, int64_t n,
                        float* out, int64_t ldo) {
  const int64_t k = rows.k, groups = k / group;
  const float* x = rows.x + r * k;
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    float t = 0.f;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) t += q[n * k + i] * x[i];
    total += sc[n * groups + g] * t;
  }
  out[r * ldo + n] = total;
}

// Rows [r0, r0 + MR) for columns [n0, n1).
template <int MR>
void rows_pass(const Rows& rows, int64_t r0, int bits, const void* q, const float* sc, const float* mn,
               int64_t group, int64_t n0, int64_t n1, float* out, int64_t ldo) {
  constexpr int NC = MR == 1 ? 4 : (MR <= 4 ? 2 : 1);
  int64_t n = n0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  for (; n + NC <= n1; n += NC) {
    if (bits == 4) int4_tile<MR, NC>(rows, r0, static_cast<const uint8_t*>(q), sc, mn, group, n, out, ldo);
    else int8_tile<MR, NC>(rows, r0, static_cast<const int8_t*>(q), sc, group, n, out, ldo);
  }
#endif
  for (; n < n1; ++n)
    for (int r = 0; r < MR; ++r) {
      if (bits == 4) int4_scalar(rows, r0 + r, static_cast<const uint8_t*>(q), sc, mn, group, n, out, ldo);
      else int8_scalar(rows, r0 + r, static_cast<const int8_t*>(q), sc, group, n, out, ldo);
    }
}

// out[m, N] (float32) = rows x dequant(W)^T, for m <= kMaxFusedRows; one parallel region.
void fused_rows(const Rows& rows, int64_t m, int64_t nout, int bits, const void* q, const float* sc,
                const float* mn, int64_t group, float* out) {
  // Column blocks of 16: whole tiles per thread, and enough blocks to share among threads.
  at::parallel_for(0, (nout + 15) / 16, 4, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 16, n1 = std::min(nout, b1 * 16);
    for (int64_t nb = n0; nb < n1; nb += 16) {  // a column block stays in L1 across row passes
      const int64_t ne = std::min(n1, nb + 16);
      int64_t r = 0;
      for (; r + 8 <= m; r += 8) rows_pass<8>(rows, r, bits, q, sc, mn, group, nb, ne, out, nout);
      for (; r + 4 <= m; r += 4) rows_pass<4>(rows, r, bits, q, sc, mn, group, nb, ne, out, nout);
      for (; r + 2 <= m; r += 2) rows_pass<2>(rows, r, bits, q, sc, mn, group, nb, ne, out, nout);
      for (; r < m; ++r) rows_pass<1>(rows, r, bits, q, sc, mn, group, nb, ne, out, nout);
    }
  });
}

void check_weight(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t bits,
                  int64_t group, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "quant: the packed weight must be a contiguous 2-D tensor");
  TORCH_CHECK(q.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "quant: ", bits, "-bit weights must be ",
              bits == 4 ? "uint8" : "int8");
  TORCH_CHECK(group > 0 && group % (bits == 4 ? 32 : 16) == 0 && k % group == 0, "quant: group ", group,
              " must divide K=", k, " and be a multiple of ", bits == 4 ? 32 : 16);
  TORCH_CHECK(q.size(1) == (bits == 4 ? k / 2 : k), "quant: weight has ", q.size(1), " columns for K=", k);
  const int64_t n = q.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / group, "quant: scales must be float32 [N, K/group]");
  if (bits == 4) {
    TORCH_CHECK(mins.has_value() && mins->defined() && mins->scalar_type() == at::kFloat && mins->is_contiguous() &&
                    mins->sizes() == scales.sizes(), "quant: 4-bit weights need float32 mins shaped like scales");
  }
}

// Dequantize rows [n0, n1) of W into out [n1 - n0, K] (float32).
void dequant_rows(int bits, const void* q, const float* sc, const float* mn, int64_t k, int64_t group, int64_t n0,
                  int64_t n1, float* out) {
  const int64_t groups = k / group;
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      float* o = out + (n - n0) * k;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = sc[n * groups + g], mi = bits == 4 ? mn[n * groups + g] : 0.f;
        for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
          if (bits == 4) {
            const uint8_t* bq = static_cast<const uint8_t*>(q) + n * (k / 2) + k0 / 2;
            for (int j = 0; j < 16; ++j) {
              o[k0 + j] = s * static_cast<float>(bq[j] & 15) + mi;
              o[k0 + 16 + j] = s * static_cast<float>(bq[j] >> 4) + mi;
            }
          } else {
            const int8_t* bq = static_cast<const int8_t*>(q) + n * k + k0;
            for (int j = 0; j < 32 && k0 + j < (g + 1) * group; ++j) o[k0 + j] = s * static_cast<float>(bq[j]);
          }
        }
      }
    }
  });
}

}  // namespace

// The float32 weight [N, K] that the packed one stands for (the reference, and for tests).
at::Tensor quant_dequantize(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                            int64_t bits, int64_t group) {
  const int64_t k = bits == 4 ? q.size(1) * 2 : q.size(1);
  check_weight(q, scales, mins, bits, group, k);
  auto out = at::empty({q.size(0), k}, scales.options());
  const float* mn = bits == 4 ? mins->data_ptr<float>() : nullptr;
  dequant_rows(static_cast<int>(bits), q.data_ptr(), scales.data_ptr<float>(), mn, k, group, 0, q.size(0),
               out.data_ptr<float>());
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
                        int64_t group) {
  TORCH_CHECK(x.dim() >= 1, "quant_linear: x must have a feature dimension");
  const int64_t k = x.size(-1), nout = q.size(0);
  check_weight(q, scales, mins, bits, group, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "quant_linear: x must be float32, bfloat16 or float16");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = nout;
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  const float* mn = bits == 4 ? mins->data_ptr<float>() : nullptr;
  at::Tensor y;
  if (m <= kMaxFusedRows) {
    at::Tensor xf = x.reshape({m, k}).to(at::kFloat).contiguous();
    at::Tensor xs;
    if (bits == 4) xs = xf.view({m, k / group, group}).sum(-1).contiguous();
    at::Tensor out = at::empty({m, nout}, xf.options());
    Rows rows{xf.data_ptr<float>(), bits == 4 ? xs.data_ptr<float>() : nullptr, k};
    fused_rows(rows, m, nout, static_cast<int>(bits), q.data_ptr(), scales.data_ptr<float>(), mn, group,
               out.data_ptr<float>());
    if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
    y = out.to(x.scalar_type());
  } else {  // prefill sizes: the GEMM library's throughput wins; only a chunk of W is ever dequantized
    at::Tensor x2 = x.reshape({m, k});
    y = at::empty({m, nout}, x.options());
    at::Tensor chunk = at::empty({std::min(nout, kChunkCols), k}, scales.options());
    for (int64_t n0 = 0; n0 < nout; n0 += kChunkCols) {
      const int64_t n1 = std::min(nout, n0 + kChunkCols);
      dequant_rows(static_cast<int>(bits), q.data_ptr(), scales.data_ptr<float>(), mn, k, group, n0, n1,
                   chunk.data_ptr<float>());
      at::Tensor w = chunk.narrow(0, 0, n1 - n0).to(x.scalar_type());
      std::optional<at::Tensor> b;
      if (bias.has_value() && bias->defined()) b = bias->narrow(0, n0, n1 - n0).to(x.scalar_type());
      y.narrow(1, n0, n1 - n0).copy_(at::linear(x2, w, b));
    }
  }
  return y.view(shape);
}

}  // namespace tapllm

#define TAPLLM_QUANT_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TAPLLM_QUANT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TAPLLM_QUANT_FRAGMENT(TAPLLM_NS, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor? mins, Tensor? bias, int bits, int group) -> Tensor");
  m.def("quant_dequantize(Tensor q, Tensor scales, Tensor? mins, int bits, int group) -> Tensor");
}

TAPLLM_QUANT_IMPL(TAPLLM_NS, CPU, m) {
  m.impl("quant_linear", &tapllm::quant_linear);
  m.impl("quant_dequantize", &tapllm::quant_dequantize);
}
