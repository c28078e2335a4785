// Prompt-sized products of int8-rounded rows and 4-bit weight blocks (int4, Q4_0, Q4_K), as a
// GEMM with 8 output columns per vector instead of 8 inputs of one column (quant_a8.cpp's tiles).
//
// The per-row tiles spend, for every row, column and run of 32 inputs, a widening, a conversion
// and a multiply-add on one column's 8 partial sums; here a run of 8 columns costs those once.
// The weights' integers of 16 columns are decoded once per call into a panel laid out 4 inputs x
// 8 columns per 32 bytes, so one vpmaddubsw multiplies 4 inputs of a row (broadcast) by 8 columns.
// The 4-bit integers are 0..15 and x is -127..127: the 16 products a lane gathers over a run
// (8 vpmaddubsw pairs) stay within int16 (16 * 15 * 127 = 30480), so a run is added up in int16
// and widened once. The result is the same sum as the tiles' up to float32 summation order.
// (llama.cpp repacks Q4 weights at load for its GEMMs; packing per call keeps the file's bytes
// the only copy and costs ~1/m of the products.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_a8.h"

namespace tapllm {
namespace quant {
namespace {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr int kNV = 2;            // vectors of 8 columns per panel
constexpr int kCols = 8 * kNV;    // columns per panel
constexpr int kMR = 3;            // rows per kernel call: 3 x 2 float and 3 x 2 int16 accumulators, 16 registers in all

// A panel of kCols columns: q [K/4][kNV][8 columns][4 inputs] unsigned, a [runs][kCols] the
// weight scale of each run, b [sum groups][kCols] the factor of each group's sum of x (the
// 4-bit kinds' offset: int4's min, Q4_0's -8d, Q4_K's -dmin * m).
struct Panel {
  std::vector<uint8_t> q;
  std::vector<float> a, b;
  explicit Panel(const Layout& l) : q(l.k * kCols), a(l.k / kRun * kCols), b(l.k / sum_run(l) * kCols) {}
};

// 8 rows of 8 int32 transposed in place (row c, lane j -> row j, lane c).
inline void transpose8(__m256i (&r)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 4h..4h+3 -> u[4h + lane pair]
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}

// Run t (of 32 inputs) of a block as 32 unsigned bytes; T a compile-time constant for Q4_K.
template <int KIND>
inline __m256i run_bytes(const uint8_t* blk, int64_t t) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  if constexpr (KIND == kQ4K) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + (t >> 1) * 32));
    return _mm256_and_si256(t & 1 ? _mm256_srli_epi16(raw, 4) : raw, low);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == kInt4 ? 4 : 2) + t * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
  }
}

// A block's scales into the panel: a (stride kCols) for each of its runs, b for its sum groups.
template <int KIND>
inline void block_scales(const uint8_t* blk, int64_t runs, float* a, float* b) {
  if constexpr (KIND == kQ4K) {
    KScales ks;
    k_scales(kQ4K, blk, ks);
    for (int t = 0; t < 8; ++t) {
      a[t * kCols] = ks.d[t];
      b[t * kCols] = ks.m[t];
    }
  } else {
    const float d = half_at(blk);
    for (int64_t t = 0; t < runs; ++t) a[t * kCols] = d;
    b[0] = KIND == kInt4 ? half_at(blk + 2) : -8.f * d;
  }
}

// Columns [n, n + kCols) of w into p; columns past N get zeros.
template <int KIND>
void pack(const Layout& l, const uint8_t* w, int64_t n, Panel& p) {
  const int64_t rb = l.group / kRun, sums_per_block = KIND == kQ4K ? 8 : 1;
  for (int v = 0; v < kNV; ++v) {
    const uint8_t* col[8];
    int valid = 0;
    for (int c = 0; c < 8 && n + 8 * v + c < l.n; ++c, ++valid) col[c] = w + (n + 8 * v + c) * l.groups * l.bytes;
    for (int64_t blk = 0; blk < l.groups; ++blk) {
      for (int c = 0; c < 8; ++c) {
        float* a = p.a.data() + blk * rb * kCols + 8 * v + c;
        float* b = p.b.data() + blk * sums_per_block * kCols + 8 * v + c;
        if (c < valid) {
          block_scales<KIND>(col[c] + blk * l.bytes, rb, a, b);
        } else {
          for (int64_t t = 0; t < rb; ++t) a[t * kCols] = 0.f;
          for (int64_t t = 0; t < sums_per_block; ++t) b[t * kCols] = 0.f;
        }
      }
      for (int64_t t = 0; t < rb; ++t) {
        __m256i r[8];
        for (int c = 0; c < 8; ++c)
          r[c] = c < valid ? run_bytes<KIND>(col[c] + blk * l.bytes, t) : _mm256_setzero_si256();
        transpose8(r);  // r[i]: inputs 4i..4i+3 of the 8 columns
        const int64_t j = blk * rb + t;
        for (int i = 0; i < 8; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.q.data() + ((j * 8 + i) * kNV + v) * 32), r[i]);
      }
    }
  }
}

// Run j of MR rows: their 32 products with each column added up in int16 (8 vpmaddubsw), widened
// once, times the run's weight scale and each row's step dx, into acc.
template <int MR>
inline void add_run(const Panel& p, const int8_t* const (&xr)[MR], const float* const (&dx)[MR], int64_t j,
                    __m256 (&acc)[MR][kNV]) {
  __m256i s16[MR][kNV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) s16[r][v] = _mm256_setzero_si256();
  const uint8_t* qp = p.q.data() + j * 8 * kNV * 32;
#pragma GCC unroll 1  // unrolled, GCC computes all 8 products first and spills them
  for (int i = 0; i < 8; ++i) {
    __m256i wv[kNV];
    for (int v = 0; v < kNV; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + (i * kNV + v) * 32));
    for (int r = 0; r < MR; ++r) {
      int32_t quad;  // inputs 4i..4i+3 of the run, in every lane
      std::memcpy(&quad, xr[r] + j * kRun + 4 * i, 4);
      const __m256i xb = _mm256_set1_epi32(quad);
      for (int v = 0; v < kNV; ++v) s16[r][v] = _mm256_add_epi16(s16[r][v], _mm256_maddubs_epi16(wv[v], xb));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int v = 0; v < kNV; ++v) {
    const __m256 a = _mm256_loadu_ps(p.a.data() + j * kCols + 8 * v);
    for (int r = 0; r < MR; ++r) {
      const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r][v], ones)), a);
      acc[r][v] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dx[r][j]), acc[r][v]);
    }
  }
}

// out rows [r0, r0 + MR) x the panel's columns, into tmp [MR][kCols].
template <int MR>
void kernel(const Layout& l, const Panel& p, const QRows& x, int64_t r0, float* tmp) {
  const int64_t k = l.k, runs = k / kRun, per_sum = sum_run(l) / kRun, sums = k / sum_run(l);
  __m256 acc[MR][kNV];
  const int8_t* xr[MR];
  const float* dx[MR];
  for (int r = 0; r < MR; ++r) {
    xr[r] = x.q + (r0 + r) * k;
    dx[r] = x.dx + (r0 + r) * runs;
    for (int v = 0; v < kNV; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < sums; ++g) {
    for (int64_t j = g * per_sum; j < (g + 1) * per_sum; ++j) add_run<MR>(p, xr, dx, j, acc);
    for (int v = 0; v < kNV; ++v) {  // the group's offset times its sum of x
      const __m256 b = _mm256_loadu_ps(p.b.data() + g * kCols + 8 * v);
      for (int r = 0; r < MR; ++r)
        acc[r][v] = _mm256_fmadd_ps(b, _mm256_set1_ps(x.s[(r0 + r) * sums + g]), acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) _mm256_storeu_ps(tmp + r * kCols + 8 * v, acc[r][v]);
}

template <int KIND>
void gemm(const Layout& l, const QRows& x, int64_t m, const uint8_t* w, float* out) {
  const int64_t panels = (l.n + kCols - 1) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel p(l);
    float tmp[kMR * kCols];
    for (int64_t pi = p0; pi < p1; ++pi) {
      const int64_t n = pi * kCols, cols = std::min<int64_t>(kCols, l.n - n);
      pack<KIND>(l, w, n, p);
      for (int64_t r0 = 0; r0 < m;) {
        const int64_t mr = std::min<int64_t>(kMR, m - r0);
        if (mr == 3) kernel<3>(l, p, x, r0, tmp);
        else if (mr == 2) kernel<2>(l, p, x, r0, tmp);
        else kernel<1>(l, p, x, r0, tmp);
        for (int64_t r = 0; r < mr; ++r) std::memcpy(out + (r0 + r) * l.n + n, tmp + r * kCols, cols * sizeof(float));
        r0 += mr;
      }
    }
  });
}
#endif

}  // namespace

bool a8_gemm_kind(Kind kind) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return kind == kInt4 || kind == kQ40 || kind == kQ4K;
#else
  (void)kind;
  return false;
#endif
}

void a8_gemm(const Layout& l, const QRows& x, int64_t m, const uint8_t* w, float* out) {
  TORCH_CHECK(a8_gemm_kind(l.kind), "a8_gemm: blocks of kind ", static_cast<int>(l.kind), " are not taken here");
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (l.kind == kInt4) gemm<kInt4>(l, x, m, w, out);
  else if (l.kind == kQ40) gemm<kQ40>(l, x, m, w, out);
  else gemm<kQ4K>(l, x, m, w, out);
#else
  (void)x, (void)m, (void)w, (void)out;
#endif
}

}  // namespace quant
}  // namespace tapllm
