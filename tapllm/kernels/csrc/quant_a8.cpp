// Quantized linears with the activations rounded to int8 too (llama.cpp's scheme for its Q4/Q8
// weights): each row of x is rounded per run of 32 inputs, xi = rint(x * 127 / amax) with
// dx = amax / 127, and the weights' integers multiply xi as integers (vpmaddubsw: 32 products
// in two instructions), so a block costs a few integer instructions instead of the float
// path's widening of every weight to float32 (which bounds quant.cpp on AVX2).
//
// The result is x_hat @ dequant(W)^T + b with x_hat = xi * dx (what tapllm/quant/pack.py's
// round_activations computes): it differs from that in float32 only by the order of the sums.
// A run whose amax is 0 gets xi = 0; one whose amax is not finite gets xi = 0 and dx = inf or
// NaN, so non-finite inputs still make non-finite outputs. GGUF's K-quants (Q4_K, Q6_K) have
// integer sub-block scales, which the integer products take in before the one conversion.
// From 8 rows up the 4-bit kinds go to a GEMM with the columns in the vector lanes (quant_a8_gemm.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "quant_a8.h"

namespace tapllm {
using namespace quant;
namespace {

// From 8 rows the 4-bit kinds take the integer GEMM (quant_a8_gemm.cpp: per call it decodes the
// weights once into a panel, which fewer rows do not repay; at 8 rows it mostly beats the tiles,
// from 16 clearly). The other kinds take the tiles up to 16 rows, then the rounded x through
// quant.cpp's dequantize-then-GEMM path.
constexpr int64_t kGemmRows = 8;
constexpr int64_t kMaxIntRows = 16;

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
  const TileCols<NC> cols(l, w, n);
  for (int64_t b = 0; b < groups; ++b) {
    cols.ahead.touch(b);
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = cols.col[c] + b * bytes;
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

// The K-quant kinds, a run of 32 inputs at a time. The 16 pair sums of vpmaddubsw are multiplied
// by the run's integer scale in vpmaddwd (Q4_K's 6-bit one; Q6_K's two int8 ones, one per half of
// the lanes), so a run costs one conversion and one multiply-add by x's step; the super-block's
// float d scales the sum once. Q4_K's nibbles are unsigned and multiply x directly (its mins times
// the runs' sums of x come in once per super-block, 8 runs in one vector); Q6_K's signed integers
// go by the sign trick.
template <int MR, int KIND, int P>
inline void k_pair(const uint8_t* blk, const uint8_t* sc, const QRows& x, int64_t r0, int64_t k, int64_t run0,
                   __m256 (&sum)[MR]) {
  __m256i q[2];
  k_pair_bytes<KIND, P>(blk, q[0], q[1]);
  const int64_t runs = k / kRun;
  for (int h = 0; h < 2; ++h) {
    const int t = 2 * P + h;
    const int64_t run = run0 + t;
    const __m256i scale = KIND == kQ4K ? _mm256_set1_epi16(sc[t])
                                       : _mm256_set_m128i(_mm_set1_epi16(static_cast<int8_t>(sc[2 * t + 1])),
                                                          _mm_set1_epi16(static_cast<int8_t>(sc[2 * t])));
    const __m256i wu = KIND == kQ4K ? q[h] : _mm256_sign_epi8(q[h], q[h]);
    for (int r = 0; r < MR; ++r) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (r0 + r) * k + run * kRun));
      if constexpr (KIND == kQ6K) xv = _mm256_sign_epi8(xv, q[h]);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), scale));
      sum[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(x.dx[(r0 + r) * runs + run]), sum[r]);
    }
  }
}

template <int MR, int NC, int KIND>
inline void tile_k(const Layout& l, const QRows& x, int64_t r0, const uint8_t* w, int64_t n, float* out) {
  const int64_t k = l.k, groups = l.groups, bytes = l.bytes, runs = k / kRun;
  __m256 acc[NC][MR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = _mm256_setzero_ps();
  const TileCols<NC> cols(l, w, n);
  for (int64_t b = 0; b < groups; ++b) {
    cols.ahead.touch(b);
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = cols.col[c] + b * bytes;
      uint8_t sm[16];  // Q4_K: 8 scales, 8 mins; Q6_K: its 16 int8 scales as stored
      if constexpr (KIND == kQ4K) q4k_unpack_scales(blk + 4, sm);
      else std::memcpy(sm, blk + 192, 16);
      __m256 sum[MR];
      for (int r = 0; r < MR; ++r) sum[r] = _mm256_setzero_ps();
      k_pair<MR, KIND, 0>(blk, sm, x, r0, k, b * 8, sum);
      k_pair<MR, KIND, 1>(blk, sm, x, r0, k, b * 8, sum);
      k_pair<MR, KIND, 2>(blk, sm, x, r0, k, b * 8, sum);
      k_pair<MR, KIND, 3>(blk, sm, x, r0, k, b * 8, sum);
      const __m256 d = _mm256_set1_ps(half_at(KIND == kQ4K ? blk : blk + 208));
      for (int r = 0; r < MR; ++r) acc[c][r] = _mm256_fmadd_ps(d, sum[r], acc[c][r]);
      if constexpr (KIND == kQ4K) {  // minus dmin * m[t] * (x's sum over run t), lane t
        const __m256 mins = _mm256_mul_ps(
            _mm256_set1_ps(half_at(blk + 2)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)))));
        for (int r = 0; r < MR; ++r)
          acc[c][r] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(x.s + (r0 + r) * runs + b * 8), acc[c][r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[(r0 + r) * l.n + n + c] = hsum(acc[c][r]);
}

template <int MR, int NC, int KIND>
inline void tile_of(const Layout& l, const QRows& x, int64_t r0, const uint8_t* w, int64_t n, float* out) {
  if constexpr (KIND == kQ4K || KIND == kQ6K) {
    tile_k<MR, NC, KIND>(l, x, r0, w, n, out);
  } else {
    switch (l.group) {
      case 32: return tile<MR, NC, KIND, 32>(l, x, r0, w, n, out);
      case 64: return tile<MR, NC, KIND, 64>(l, x, r0, w, n, out);
      case 128: return tile<MR, NC, KIND, 128>(l, x, r0, w, n, out);
      default: return tile<MR, NC, KIND, 0>(l, x, r0, w, n, out);
    }
  }
}
#endif

// One row x one column with the same integer sums (the generic build, and leftover columns).
float dot_scalar(const Layout& l, const QRows& x, int64_t r, const uint8_t* w, int64_t n) {
  const int64_t runs = l.k / kRun, hdr = l.kind == kInt4 ? 4 : 2;
  float total = 0.f;
  if (is_k(l.kind)) {
    for (int64_t b = 0; b < l.groups; ++b) {
      const uint8_t* blk = w + (n * l.groups + b) * l.bytes;
      KScales ks;
      k_scales(l.kind, blk, ks);
      for (int t = 0; t < 8; ++t) {
        int8_t q[32];
        k_run(l.kind, blk, t, q);
        const int64_t j = b * 8 + t;
        const int8_t* xq = x.q + r * l.k + j * kRun;
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < 16; ++i) {
          s0 += q[i] * xq[i];
          s1 += q[16 + i] * xq[16 + i];
        }
        const float dot = k_scale(l.kind, ks, t, 0) * static_cast<float>(s0) +
                          k_scale(l.kind, ks, t, 1) * static_cast<float>(s1);
        total += dot * x.dx[r * runs + j] + ks.m[t] * x.s[r * runs + j];
      }
    }
    return total;
  }
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
  const bool gemm = m >= kGemmRows && a8_gemm_kind(l.kind);
  if (!gemm && m > kMaxIntRows)  // prefill sizes: the rounded activations through the float GEMM path
    return quant_linear(round_activations(x).to(x.scalar_type()), w, bias, 0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = l.n;
  at::Tensor xf = x.reshape({m, k}).to(at::kFloat).contiguous();
  std::vector<int8_t> q(m * k);
  const int64_t sums = sum_run(l);
  std::vector<float> dx(m * (k / kRun)), s(m * (k / sums));
  round_rows(xf.data_ptr<float>(), m, k, sums, q.data(), dx.data(), s.data());
  at::Tensor out = at::empty({m, l.n}, xf.options());
  const QRows rows{q.data(), dx.data(), s.data()};
  if (gemm) a8_gemm(l, rows, m, w.data_ptr<uint8_t>(), out.data_ptr<float>());
  else int_rows(l, rows, m, w.data_ptr<uint8_t>(), out.data_ptr<float>());
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace tapllm
