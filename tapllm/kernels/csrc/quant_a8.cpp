// Quantized linears with the activations rounded to int8 too (llama.cpp's scheme for its Q4/Q8
// weights): each row of x is rounded per run of 32 inputs, xi = rint(x * 127 / amax) with
// dx = amax / 127, and the weights' integers multiply xi as integers (vpmaddubsw: 32 products
// in two instructions), so a block costs a few integer instructions instead of the float
// path's widening of every weight to float32 (which bounds quant.cpp on AVX2).
//
// The result is x_hat @ dequant(W)^T + b with x_hat = xi * dx (what tapllm/quant/pack.py's
// round_activations computes): it differs from that in float32 only by the order of the sums.
// A run whose amax is 0 gets xi = 0; one whose amax is not finite gets xi = 0 and dx = inf or
// NaN, so non-finite inputs still make non-finite outputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "quant_layout.h"

namespace tapllm {
using namespace quant;
namespace {

constexpr int64_t kRun = 32;             // inputs per activation scale
constexpr int64_t kMaxIntRows = 16;  // more rows: rounded x, then quant.cpp's dequantize-then-GEMM path

// Rows of x rounded: q [m, K] int8, dx [m, K/32], s [m, G] = per weight group, sum of dx * sum(q).
struct QRows {
  const int8_t* q;
  const float* dx;
  const float* s;
};

void round_rows(const float* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* dx, float* s) {
  const int64_t runs = k / kRun, per_group = group / kRun;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < runs; ++j) {
      const float* xr = x + r * k + j * kRun;
      int8_t* qr = q + r * k + j * kRun;
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < kRun; ++i) {
        amax = std::max(amax, std::fabs(xr[i]));
        finite &= std::isfinite(xr[i]);
      }
      if (!finite) amax = INFINITY;  // std::max skipped any NaN: the run's step is infinite, its products NaN
      dx[r * runs + j] = amax / 127.f;
      int32_t sum = 0;
      if (amax > 0.f && std::isfinite(amax)) {
        const float inv = 127.f / amax;
        for (int64_t i = 0; i < kRun; ++i) {
          const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xr[i] * inv)));
          qr[i] = static_cast<int8_t>(v);
          sum += qr[i];
        }
      } else {
        for (int64_t i = 0; i < kRun; ++i) qr[i] = 0;
      }
      const int64_t g = j / per_group;
      if (j % per_group == 0) s[r * (k / group) + g] = 0.f;
      s[r * (k / group) + g] += dx[r * runs + j] * static_cast<float>(sum);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// 16 bytes of nibbles -> 32 unsigned bytes in GGUF's order (the low nibbles are inputs 0-15).
inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// 32 products of unsigned w and signed x, summed into 8 int32 lanes, as float.
inline __m256 dot32(__m256i w, __m256i x) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [r0, r0 + MR) x columns [n, n + NC); KIND and the group size GS (> 0) fixed at compile time.
template <int MR, int NC, int KIND, int GS>
inline void tile(const Layout& l, const QRows& x, int64_t r0, const uint8_t* w, int64_t n, float* out) {
  constexpr bool kFour = KIND != kInt8;
  constexpr int64_t kHdr = KIND == kInt4 ? 4 : 2;
  const int64_t k = l.k, g = GS > 0 ? GS : l.group, groups = l.groups, bytes = l.bytes, runs = k / kRun;
  __m256 acc[MR][NC];
  float mterm[MR][NC] = {};
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* col[NC];
  for (int c = 0; c < NC; ++c) col[c] = w + (n + c) * groups * bytes;
  const Ahead ahead(l, w, n, NC);
  for (int64_t b = 0; b < groups; ++b) {
    ahead.touch(b);
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = col[c] + b * bytes;
      const float d = half_at(blk);
      __m256 t[MR];
      for (int r = 0; r < MR; ++r) t[r] = _mm256_setzero_ps();
      for (int64_t s = 0; s < g; s += kRun) {
        const int64_t run = (b * g + s) / kRun;
        __m256i wv;
        if constexpr (kFour) wv = nibbles(blk + kHdr + s / 2);
        else wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kHdr + s));
        const __m256i wu = kFour ? wv : _mm256_sign_epi8(wv, wv);  // |w| with x's sign flipped where w < 0
        for (int r = 0; r < MR; ++r) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (r0 + r) * k + b * g + s));
          if constexpr (!kFour) xv = _mm256_sign_epi8(xv, wv);
          const float scale = GS == kRun ? d * x.dx[(r0 + r) * runs + run] : x.dx[(r0 + r) * runs + run];
          t[r] = _mm256_fmadd_ps(dot32(wu, xv), _mm256_set1_ps(scale), t[r]);
        }
      }
      for (int r = 0; r < MR; ++r)
        acc[r][c] = GS == kRun ? _mm256_add_ps(acc[r][c], t[r]) : _mm256_fmadd_ps(_mm256_set1_ps(d), t[r], acc[r][c]);
      if constexpr (kFour) {
        const float m = KIND == kInt4 ? half_at(blk + 2) : -8.f * d;
        for (int r = 0; r < MR; ++r) mterm[r][c] += m * x.s[(r0 + r) * groups + b];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[(r0 + r) * l.n + n + c] = hsum(acc[r][c]) + mterm[r][c];
}

template <int MR, int NC, int KIND>
inline void tile_of(const Layout& l, const QRows& x, int64_t r0, const uint8_t* w, int64_t n, float* out) {
  switch (l.group) {
    case 32: return tile<MR, NC, KIND, 32>(l, x, r0, w, n, out);
    case 64: return tile<MR, NC, KIND, 64>(l, x, r0, w, n, out);
    case 128: return tile<MR, NC, KIND, 128>(l, x, r0, w, n, out);
    default: return tile<MR, NC, KIND, 0>(l, x, r0, w, n, out);
  }
}
#endif

// One row x one column with the same integer sums (the generic build, and leftover columns).
float dot_scalar(const Layout& l, const QRows& x, int64_t r, const uint8_t* w, int64_t n) {
  const int64_t runs = l.k / kRun, hdr = l.kind == kInt4 ? 4 : 2;
  float total = 0.f;
  for (int64_t b = 0; b < l.groups; ++b) {
    const uint8_t* blk = w + (n * l.groups + b) * l.bytes;
    const float d = half_at(blk);
    float t = 0.f;
    for (int64_t s = 0; s < l.group; s += kRun) {
      const int8_t* xq = x.q + r * l.k + b * l.group + s;
      int32_t isum = 0;
      for (int j = 0; j < kRun; ++j) {
        int32_t q;
        if (l.kind == kInt8) q = static_cast<int8_t>(blk[hdr + s + j]);
        else q = j < 16 ? blk[hdr + s / 2 + j] & 15 : blk[hdr + s / 2 + j - 16] >> 4;
        isum += q * xq[j];
      }
      t += static_cast<float>(isum) * x.dx[r * runs + (b * l.group + s) / kRun];
    }
    total += d * t;
    if (l.kind != kInt8) total += (l.kind == kInt4 ? half_at(blk + 2) : -8.f * d) * x.s[r * l.groups + b];
  }
  return total;
}

void int_rows(const Layout& l, const QRows& x, int64_t m, const uint8_t* w, float* out) {
  for_tiles(
      l, m,
      [&](auto mr, auto nc, auto kind, int64_t r0, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
        tile_of<decltype(mr)::value, decltype(nc)::value, decltype(kind)::value>(l, x, r0, w, n, out);
#endif
      },
      [&](int64_t r, int64_t n) { out[r * l.n + n] = dot_scalar(l, x, r, w, n); });
}

}  // namespace

at::Tensor round_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kRun == 0, "round_activations: the last dimension must be a multiple of 32");
  const int64_t k = x.size(-1), m = k > 0 ? x.numel() / k : 0;
  at::Tensor xf = x.reshape({m, k}).to(at::kFloat).contiguous();
  at::Tensor q = at::empty({m, k}, xf.options().dtype(at::kChar));
  at::Tensor dx = at::empty({m, k / kRun}, xf.options()), s = at::empty({m, k / kRun}, xf.options());
  round_rows(xf.data_ptr<float>(), m, k, kRun, q.data_ptr<int8_t>(), dx.data_ptr<float>(), s.data_ptr<float>());
  return (q.to(at::kFloat).view({m, k / kRun, kRun}) * dx.unsqueeze(-1)).view(x.sizes());
}

at::Tensor quant_linear_a8(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const int64_t k = x.size(-1);  // x checked by quant_linear
  const Layout l = layout_of(w, k);
  const int64_t m = k > 0 ? x.numel() / k : 0;
  if (m > kMaxIntRows)  // prefill sizes: the rounded activations through the float GEMM path
    return quant_linear(round_activations(x).to(x.scalar_type()), w, bias, 0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = l.n;
  at::Tensor xf = x.reshape({m, k}).to(at::kFloat).contiguous();
  std::vector<int8_t> q(m * k);
  std::vector<float> dx(m * (k / kRun)), s(m * l.groups);
  round_rows(xf.data_ptr<float>(), m, k, l.group, q.data(), dx.data(), s.data());
  at::Tensor out = at::empty({m, l.n}, xf.options());
  int_rows(l, QRows{q.data(), dx.data(), s.data()}, m, w.data_ptr<uint8_t>(), out.data_ptr<float>());
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace tapllm

#define TAPLLM_A8_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TAPLLM_A8_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TAPLLM_A8_FRAGMENT(TAPLLM_NS, m) { m.def("round_activations(Tensor x) -> Tensor"); }

TAPLLM_A8_IMPL(TAPLLM_NS, CPU, m) { m.impl("round_activations", &tapllm::round_activations); }
