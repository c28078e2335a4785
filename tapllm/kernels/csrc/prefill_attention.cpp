// Causal attention of prefill chunks over the paged KV cache, read in place.
//
// A chunk's queries sit at positions [context, context + n) of its sequence; its keys and
// values (the cached context and the chunk itself, already written by kv_write) are read from
// the sequence's blocks. One task is (chunk, KV head, block of QB query positions): its G query
// heads share every key tile, copied (and widened, or paired for vdpbf16ps) once per task.
//
// Vector lanes run over query positions: a row vector is W consecutive positions of one head, so
// the online softmax (max, exp, sum, rescale) is lane-wise and needs no horizontal reductions.
// Scores S^T[key][rows] and outputs O^T[dim][rows] are register-tiled over R row vectors times
// J keys (or J output dimensions), the other operand broadcast from the key or value tile.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels.h"

namespace tapllm {
namespace {

constexpr int64_t W = Vec::size();
constexpr int64_t KT = 64;  // keys per tile
constexpr int64_t QB = 64;  // query positions per task (a multiple of W)
constexpr int J = 8;        // keys (scores) or output dimensions (values) per register block
#if defined(CPU_CAPABILITY_AVX512)
constexpr int RMAX = 3;     // row vectors per register block: 3 x 8 accumulators of 32 zmm
#else
constexpr int RMAX = 1;     // 16 ymm registers
#endif
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// 2^t for t <= ~0 (scaled scores minus their running maximum): t = n + f with |f| <= 1/2 and
// a degree-6 fit of 2^f (relative error 2e-8; Coarse: degree 4, 3e-6, for probabilities that are
// rounded to bfloat16 anyway). With Clamp, -inf and NaN (-inf - -inf) give 0; without, t must be
// finite (anything far below -126 still gives 0).
template <bool Clamp, bool Coarse = false>
inline Vec exp2_neg(Vec t) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = Clamp ? _mm512_max_ps(t, _mm512_set1_ps(-200.f)) : __m512(t);  // NaN: max gives its 2nd operand
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (Coarse) {
    p = _mm512_set1_ps(9.56051052e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.59170395e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40249813e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312197e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99999166e-1f));
  } else {
    p = _mm512_set1_ps(1.54697322e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.34004327e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61802527e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55032715e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147182e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  }
  return _mm512_scalef_ps(p, n);  // 2^-200 underflows to 0
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x = _mm256_max_ps(t, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.54697322e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.34004327e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61802527e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55032715e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40226507e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147182e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // 2^n from its exponent bits; n = -127 gives the bits of 0
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
#else
  const Vec x = Vec::blendv(Vec(-200.f), t, t > Vec(-200.f));
  return x.exp2();
#endif
}

// Where one task's rows are: row vector rv holds positions first + (rv / group) * W + lane of
// query head hk * group + rv % group.
struct Rows {
  int64_t ctx, first, n, group;
  int64_t pos(int64_t rv) const { return ctx + first + rv / group * W; }  // of lane 0
  int64_t count(int64_t rv) const { return std::min<int64_t>(W, n - rv / group * W); }  // real lanes
};

// The softmax state of R row vectors at one key tile: which keys each lane sees, the running
// maximum of the raw (or transformed) scores, and the factor of the exponent.
struct TileRows {
  bool masked, transform;
  float scale, softcap, cscale;  // cscale: scale * log2(e), or log2(e) when the scores are transformed
  alignas(64) float hi[RMAX][W], lo[RMAX][W], mx[RMAX][W];
};

// The keys [js, je) of the tile at k0 (nk real keys) that row vectors rv0..rv0+R-1 need, in whole
// register blocks of J (empty when none), and their softmax state; mx starts at the rows' maximum m.
inline void tile_rows(TileRows& tr, const Rows& rows, int64_t rv0, int R, int64_t k0, int64_t nk, int64_t window,
                      float scale, float softcap, const float* m, int64_t& js, int64_t& je) {
  int64_t pmin = rows.pos(rv0), pmax = rows.pos(rv0);
  for (int r = 1; r < R; ++r) {
    pmin = std::min(pmin, rows.pos(rv0 + r));
    pmax = std::max(pmax, rows.pos(rv0 + r));
  }
  pmax += W - 1;
  const int64_t hi = std::min(nk, pmax + 1 - k0);  // keys [0, hi) of the tile
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pmin - window + 1 - k0) : 0;
  js = lo / J * J;
  je = hi <= lo ? js : (hi + J - 1) / J * J;
  tr.transform = softcap > 0.f || !(scale > 0.f);
  tr.scale = scale;
  tr.softcap = softcap;
  tr.cscale = tr.transform ? kLog2e : scale * kLog2e;
  // keys past a lane's position, past the tile's real keys or before the window get -inf
  tr.masked = k0 + je - 1 > std::min(pmin, k0 + nk - 1) || (window > 0 && pmax - window + 1 > k0 + js);
  alignas(64) static const float iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int r = 0; r < R; ++r) {
    if (tr.masked) {  // the lanes' visible keys [lo, hi] relative to k0 (exact in float32)
      const int64_t p0 = rows.pos(rv0 + r);
      at::vec::minimum(Vec(static_cast<float>(p0 - k0)) + Vec::loadu(iota), Vec(static_cast<float>(nk - 1)))
          .store(tr.hi[r]);
      (window > 0 ? Vec(static_cast<float>(p0 - window + 1 - k0)) + Vec::loadu(iota) : Vec(-1.f)).store(tr.lo[r]);
    }
    Vec::loadu(m + (rv0 + r) * W).store(tr.mx[r]);
  }
}

// A score of key j (of the tile) for row vector r as the softmax takes it: soft-capped, masked.
inline Vec score(Vec x, const TileRows& tr, int r, int64_t j) {
  if (tr.transform) {
    x = x * Vec(tr.scale);
    if (tr.softcap > 0.f) x = (x * Vec(1.f / tr.softcap)).tanh() * Vec(tr.softcap);
  }
  if (tr.masked) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 key = _mm512_set1_ps(static_cast<float>(j));
    const __mmask16 out = _mm512_cmp_ps_mask(key, _mm512_loadu_ps(tr.hi[r]), _CMP_GT_OQ) |
                          _mm512_cmp_ps_mask(key, _mm512_loadu_ps(tr.lo[r]), _CMP_LT_OQ);
    x = _mm512_mask_mov_ps(x, out, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
#else
    const Vec key(static_cast<float>(j));
    x = Vec::blendv(x, Vec(-std::numeric_limits<float>::infinity()),
                    (key > Vec::loadu(tr.hi[r])) | (key < Vec::loadu(tr.lo[r])));
#endif
  }
  return x;
}

// Row vector r's new running maximum: m := tr.mx; the exponent offset (mu * cscale, mu = 0 for a row
// without any visible key yet) to subtract; alpha: the factor of the row's earlier sum and output.
inline Vec rescale(const TileRows& tr, int r, float* m, float* alpha) {
  const Vec ninf(-std::numeric_limits<float>::infinity());
  const Vec mx = Vec::loadu(tr.mx[r]);
  const Vec mu = Vec::blendv(mx, Vec(0.f), mx == ninf);
  exp2_neg<true>((Vec::loadu(m) - mu) * Vec(tr.cscale)).store(alpha);
  mx.store(m);
  return mu * Vec(tr.cscale);
}

// Scores of R row vectors against J keys (float32), s[r][j] = sum_e q^T[e][rows] k[j][e], as
// `score` makes them, with the running maximum.
template <int R>
inline void scores_f32(const float* qt, int64_t d, const float* kt, float* s, TileRows& tr, int64_t j0) {
  Vec acc[J][R];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = Vec(0.f);
  for (int64_t e = 0; e < d; ++e) {
    Vec qv[R];
    for (int r = 0; r < R; ++r) qv[r] = Vec::loadu(qt + (r * d + e) * W);
    for (int j = 0; j < J; ++j) {
      const Vec kv(kt[j * d + e]);
      for (int r = 0; r < R; ++r) acc[j][r] = at::vec::fmadd(qv[r], kv, acc[j][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec mx = Vec::loadu(tr.mx[r]);
    for (int j = 0; j < J; ++j) {
      const Vec x = score(acc[j][r], tr, r, j0 + j);
      x.store(s + (r * KT + j0 + j) * W);
      mx = at::vec::maximum(mx, x);
    }
    mx.store(tr.mx[r]);
  }
}

// The probabilities of keys [js, je) in place of the scores; the rows' m, l and alpha updated.
template <bool Masked>
inline void softmax_f32(float* s, int R, int64_t rv0, const TileRows& tr, int64_t js, int64_t je, float* m, float* l,
                        float* alpha) {
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * KT * W;
    const Vec mc = rescale(tr, r, m + (rv0 + r) * W, alpha + r * W);
    Vec sum0(0.f), sum1(0.f);
    for (int64_t j = js; j < je; j += 2) {
      const Vec e0 = exp2_neg<Masked>(at::vec::fmsub(Vec::loadu(sr + j * W), Vec(tr.cscale), mc));
      const Vec e1 = exp2_neg<Masked>(at::vec::fmsub(Vec::loadu(sr + (j + 1) * W), Vec(tr.cscale), mc));
      e0.store(sr + j * W);
      e1.store(sr + (j + 1) * W);
      sum0 = sum0 + e0;
      sum1 = sum1 + e1;
    }
    float* lr = l + (rv0 + r) * W;
    at::vec::fmadd(Vec::loadu(lr), Vec::loadu(alpha + r * W), sum0 + sum1).store(lr);
  }
}

// O^T[d0 + i][rows] = alpha O^T[d0 + i][rows] + sum_j p[j][rows] v[j][d0 + i] for J dims i.
template <int R>
inline void values_f32(const float* p, const float* vt, int64_t dp, int64_t js, int64_t je, const float* alpha,
                       float* ot) {
  Vec acc[J][R];
  for (int r = 0; r < R; ++r) {
    const Vec a = Vec::loadu(alpha + r * W);
    for (int i = 0; i < J; ++i) acc[i][r] = Vec::loadu(ot + (r * dp + i) * W) * a;
  }
  for (int64_t j = js; j < je; ++j) {
    Vec pv[R];
    for (int r = 0; r < R; ++r) pv[r] = Vec::loadu(p + (r * KT + j) * W);
    for (int i = 0; i < J; ++i) {
      const Vec vv(vt[j * dp + i]);
      for (int r = 0; r < R; ++r) acc[i][r] = at::vec::fmadd(pv[r], vv, acc[i][r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < J; ++i) acc[i][r].store(ot + (r * dp + i) * W);
}

#if defined(CPU_CAPABILITY_AVX512)
// r[i] lane j -> r[j] lane i, for 16 x 16 32-bit elements (bits moved, never rounded).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // 128-bit lane k: rows i, i + 1 at columns 4k, 4k + 1 / 4k + 2, 4k + 3
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + c], lane k: rows i..i+3 at column 4k + c
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes over r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512 x0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
    const __m512 x2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44);
    const __m512 x3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_f32x4(x0, x2, 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(x0, x2, 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(x1, x3, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(x1, x3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// dst[e * W + i] = src[i * ld + e] for the cnt rows i of a row vector (32-bit elements; other lanes 0).
inline void rows_to_lanes(const float* src, int64_t ld, int64_t cnt, int64_t d, float* dst) {
  for (int64_t e0 = 0; e0 < d; e0 += 16) {
    const int64_t ne = std::min<int64_t>(16, d - e0);
    const __mmask16 mask = static_cast<__mmask16>((1u << ne) - 1);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < cnt ? _mm512_maskz_loadu_ps(mask, src + i * ld + e0) : _mm512_setzero_ps();
    transpose16(r);
    for (int c = 0; c < 16; ++c)
      if (c < ne) _mm512_storeu_ps(dst + (e0 + c) * 16, r[c]);
  }
}

// Row i < cnt of the output (row stride ld) = O^T[.][i] / l[i].
template <typename T>
inline void lanes_to_rows(const float* ot, const float* l, int64_t cnt, int64_t d, T* dst, int64_t ld) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(l));
  for (int64_t e0 = 0; e0 < d; e0 += 16) {
    const int64_t ne = std::min<int64_t>(16, d - e0);
    const __mmask16 mask = static_cast<__mmask16>((1u << ne) - 1);
    __m512 r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = c < ne ? _mm512_mul_ps(_mm512_loadu_ps(ot + (e0 + c) * 16), inv) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) {
      if (i >= cnt) break;
      T* o = dst + i * ld + e0;
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(o, mask, r[i]);
      } else if constexpr (std::is_same_v<T, at::BFloat16>) {
        _mm256_mask_storeu_epi16(o, mask, at::vec::cvtfp32_bf16(r[i]));
      } else {
        _mm256_mask_storeu_epi16(o, mask, _mm512_cvtps_ph(r[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
    }
  }
}
#else
inline void rows_to_lanes(const float* src, int64_t ld, int64_t cnt, int64_t d, float* dst) {
  for (int64_t i = 0; i < cnt; ++i)
    for (int64_t e = 0; e < d; ++e) dst[e * W + i] = src[i * ld + e];
}

template <typename T>
inline void lanes_to_rows(const float* ot, const float* l, int64_t cnt, int64_t d, T* dst, int64_t ld) {
  for (int64_t i = 0; i < cnt; ++i) {
    const float inv = 1.f / l[i];
    for (int64_t e = 0; e < d; ++e) dst[i * ld + e] = static_cast<T>(ot[e * W + i] * inv);
  }
}
#endif

// Row vectors in the next register block of the `left` ones: 4 split 2 + 2 rather than 3 + 1.
inline int row_block(int64_t left) {
  return static_cast<int>(RMAX == 3 && left == 4 ? 2 : std::min<int64_t>(RMAX, left));
}

struct Task {
  int64_t chunk, head, first;  // KV head; first query position (relative to the chunk)
};

// Per-thread buffers of a task.
struct Scratch {
  std::vector<float> qt, kt, vt, s, ot, m, l, alpha;
  std::vector<uint32_t> pp;
};

template <typename T>
void f32_task(const T* q, const T* kh, const T* vh, T* out, const int64_t* table, int64_t qstart, const Rows& rows,
              int64_t heads, int64_t hk, int64_t d, int64_t block_size, int64_t q_row, int64_t q_head, float scale,
              int64_t window, float softcap, Scratch& b) {
  const int64_t group = rows.group, nrv = (rows.n + W - 1) / W * group;
  const int64_t dp = (d + J - 1) / J * J;  // value and output columns, zero-padded to whole blocks
  b.qt.assign(nrv * d * W, 0.f);
  b.ot.assign(nrv * dp * W, 0.f);
  b.m.assign(nrv * W, -std::numeric_limits<float>::infinity());
  b.l.assign(nrv * W, 0.f);
  b.kt.resize(KT * d);
  b.vt.resize(KT * dp);
  b.s.resize(RMAX * KT * W);
  b.alpha.resize(RMAX * W);
  for (int64_t rv = 0; rv < nrv; ++rv) {
    const T* src = q + (qstart + rows.first + rv / group * W) * q_row + (hk * group + rv % group) * q_head;
    if constexpr (std::is_same_v<T, float>) {
      rows_to_lanes(src, q_row, rows.count(rv), d, b.qt.data() + rv * d * W);
    } else {
      for (int64_t i = 0; i < rows.count(rv); ++i)
        for (int64_t e = 0; e < d; ++e) b.qt[(rv * d + e) * W + i] = to_float(src[i * q_row + e]);
    }
  }
  const int64_t last_pos = rows.ctx + rows.first + rows.n - 1;  // no key past the last query is needed
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, rows.ctx + rows.first - window + 1) : 0;
  TileRows tr;
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
    const int64_t nk = std::min(KT, last_pos + 1 - k0);
    for (int64_t j = 0; j < KT; ++j) {
      float* krow = b.kt.data() + j * d;
      float* vrow = b.vt.data() + j * dp;
      if (j < nk) {
        const int64_t p = k0 + j;
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        const T* kr = kh + slot * d;
        const T* vr = vh + slot * d;
        int64_t e = 0;
        for (; e + W <= d; e += W) {
          loadf<T>(kr + e).store(krow + e);
          loadf<T>(vr + e).store(vrow + e);
        }
        for (; e < d; ++e) {
          krow[e] = to_float(kr[e]);
          vrow[e] = to_float(vr[e]);
        }
        for (e = d; e < dp; ++e) vrow[e] = 0.f;
      } else {
        std::fill(krow, krow + d, 0.f);
        std::fill(vrow, vrow + dp, 0.f);
      }
    }
    for (int64_t rv0 = 0, R; rv0 < nrv; rv0 += R) {
      R = row_block(nrv - rv0);
      int64_t js, je;
      tile_rows(tr, rows, rv0, R, k0, nk, window, scale, softcap, b.m.data(), js, je);
      if (je <= js) continue;
      auto run = [&](auto r_tag) {
        constexpr int RR = decltype(r_tag)::value;
        for (int64_t j0 = js; j0 < je; j0 += J)
          scores_f32<RR>(b.qt.data() + rv0 * d * W, d, b.kt.data() + j0 * d, b.s.data(), tr, j0);
        if (tr.masked) {
          softmax_f32<true>(b.s.data(), RR, rv0, tr, js, je, b.m.data(), b.l.data(), b.alpha.data());
        } else {
          softmax_f32<false>(b.s.data(), RR, rv0, tr, js, je, b.m.data(), b.l.data(), b.alpha.data());
        }
        for (int64_t i0 = 0; i0 < dp; i0 += J)
          values_f32<RR>(b.s.data(), b.vt.data() + i0, dp, js, je, b.alpha.data(), b.ot.data() + (rv0 * dp + i0) * W);
      };
      if constexpr (RMAX >= 3) {
        if (R == 3) { run(std::integral_constant<int, 3>()); continue; }
      }
      if constexpr (RMAX >= 2) {
        if (R == 2) { run(std::integral_constant<int, 2>()); continue; }
      }
      run(std::integral_constant<int, 1>());
    }
  }
  for (int64_t rv = 0; rv < nrv; ++rv)
    lanes_to_rows<T>(b.ot.data() + rv * dp * W, b.l.data() + rv * W, rows.count(rv), d,
                     out + ((qstart + rows.first + rv / group * W) * heads + hk * group + rv % group) * d, heads * d);
}

#if defined(CPU_CAPABILITY_AVX512)
#define TAPLLM_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// bfloat16 with AVX512-BF16 dot products (vdpbf16ps: 32 products summed pairwise into 16 float32
// lanes per instruction, twice the FMA rate). Q.K sums pairs of dimensions: q^T is stored as
// [d/2][rows] pairs and a key's pair (adjacent in the cache row) broadcast. P.V sums pairs of
// keys: the value tile is [KT/2][d] pairs of rows and the probabilities are rounded to bfloat16
// pairs first, as PyTorch's own bf16 attention does. Scores, softmax and accumulators are float32.
template <int R>
TAPLLM_BF16_TARGET inline void scores_bf16(const uint32_t* qt, int64_t dh, const uint32_t* kt, float* s, TileRows& tr,
                                           int64_t j0) {
  __m512 acc[J][R];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t e = 0; e < dh; ++e) {
    __m512bh qv[R];
    for (int r = 0; r < R; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qt + (r * dh + e) * 16);
    for (int j = 0; j < J; ++j) {
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(kt[j * dh + e]));
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], qv[r], kv);
    }
  }
  for (int r = 0; r < R; ++r) {
    Vec mx = Vec::loadu(tr.mx[r]);
    for (int j = 0; j < J; ++j) {
      const Vec x = score(acc[j][r], tr, r, j0 + j);
      x.store(s + (r * KT + j0 + j) * 16);
      mx = at::vec::maximum(mx, x);
    }
    mx.store(tr.mx[r]);
  }
}

// The probabilities of keys [js, je) as bfloat16 pairs pp[r][j / 2][rows]; m, l and alpha updated.
template <bool Masked>
TAPLLM_BF16_TARGET inline void softmax_bf16(const float* s, uint32_t* pp, int R, int64_t rv0, const TileRows& tr,
                                            int64_t js, int64_t je, float* m, float* l, float* alpha) {
  // word 2i of a pair from lane i of the first key, word 2i + 1 from the second key
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int r = 0; r < R; ++r) {
    const float* sr = s + r * KT * 16;
    const Vec mc = rescale(tr, r, m + (rv0 + r) * 16, alpha + r * 16);
    Vec sum0(0.f), sum1(0.f);
    for (int64_t j = js; j < je; j += 2) {
      const Vec e0 = exp2_neg<Masked, true>(at::vec::fmsub(Vec::loadu(sr + j * 16), Vec(tr.cscale), mc));
      const Vec e1 = exp2_neg<Masked, true>(at::vec::fmsub(Vec::loadu(sr + (j + 1) * 16), Vec(tr.cscale), mc));
      sum0 = sum0 + e0;
      sum1 = sum1 + e1;
      const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
      _mm512_storeu_si512(pp + (r * KT / 2 + j / 2) * 16, _mm512_permutexvar_epi16(inter, two));
    }
    float* lr = l + (rv0 + r) * 16;
    at::vec::fmadd(Vec::loadu(lr), Vec::loadu(alpha + r * 16), sum0 + sum1).store(lr);
  }
}

template <int R>
TAPLLM_BF16_TARGET inline void values_bf16(const uint32_t* pp, const uint32_t* vt, int64_t d, int64_t jps,
                                           int64_t jpe, const float* alpha, float* ot) {
  __m512 acc[J][R];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_loadu_ps(alpha + r * 16);
    for (int i = 0; i < J; ++i) acc[i][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (r * d + i) * 16), a);
  }
  for (int64_t jp = jps; jp < jpe; ++jp) {
    __m512bh pv[R];
    for (int r = 0; r < R; ++r) pv[r] = (__m512bh)_mm512_loadu_si512(pp + (r * KT / 2 + jp) * 16);
    for (int i = 0; i < J; ++i) {
      const __m512bh vv = (__m512bh)_mm512_set1_epi32(static_cast<int>(vt[jp * d + i]));
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], pv[r], vv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < J; ++i) _mm512_storeu_ps(ot + (r * d + i) * 16, acc[i][r]);
}

template <int R>
TAPLLM_BF16_TARGET void bf16_rows(Scratch& b, const uint32_t* qt, const uint32_t* kt, const uint32_t* vt, int64_t d,
                                  int64_t rv0, TileRows& tr, int64_t js, int64_t je) {
  const int64_t dh = d / 2;
  for (int64_t j0 = js; j0 < je; j0 += J)
    scores_bf16<R>(qt + rv0 * dh * 16, dh, kt + j0 * dh, b.s.data(), tr, j0);
  if (tr.masked) {
    softmax_bf16<true>(b.s.data(), b.pp.data(), R, rv0, tr, js, je, b.m.data(), b.l.data(), b.alpha.data());
  } else {
    softmax_bf16<false>(b.s.data(), b.pp.data(), R, rv0, tr, js, je, b.m.data(), b.l.data(), b.alpha.data());
  }
  for (int64_t i0 = 0; i0 < d; i0 += J)
    values_bf16<R>(b.pp.data(), vt + i0, d, js / 2, je / 2, b.alpha.data(), b.ot.data() + (rv0 * d + i0) * 16);
}

TAPLLM_BF16_TARGET void bf16_dot_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out,
                                      const int64_t* table, int64_t qstart, const Rows& rows, int64_t heads,
                                      int64_t hk, int64_t d, int64_t block_size, int64_t q_row, int64_t q_head,
                                      float scale, int64_t window, float softcap, Scratch& b,
                                      std::vector<uint32_t>& qt, std::vector<uint32_t>& kt, std::vector<uint32_t>& vt) {
  const int64_t group = rows.group, nrv = (rows.n + 15) / 16 * group, dh = d / 2;
  qt.assign(nrv * dh * 16, 0u);
  kt.resize(KT * dh);
  vt.resize(KT / 2 * d);
  b.ot.assign(nrv * d * 16, 0.f);
  b.m.assign(nrv * 16, -std::numeric_limits<float>::infinity());
  b.l.assign(nrv * 16, 0.f);
  b.s.resize(RMAX * KT * 16);
  b.pp.resize(RMAX * KT / 2 * 16);
  b.alpha.resize(RMAX * 16);
  for (int64_t rv = 0; rv < nrv; ++rv)  // pairs of bfloat16 moved as float32 bits
    rows_to_lanes(reinterpret_cast<const float*>(q + (qstart + rows.first + rv / group * 16) * q_row +
                                                 (hk * group + rv % group) * q_head),
                  q_row / 2, rows.count(rv), dh, reinterpret_cast<float*>(qt.data()) + rv * dh * 16);
  // value pairs: word 2i of a pair row from key 2jp, word 2i + 1 from key 2jp + 1
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const int64_t last_pos = rows.ctx + rows.first + rows.n - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, rows.ctx + rows.first - window + 1) : 0;
  TileRows tr;
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
    const int64_t nk = std::min(KT, last_pos + 1 - k0);
    for (int64_t j = 0; j < KT; j += 2) {
      const uint16_t* vr[2];
      for (int u = 0; u < 2; ++u) {
        if (j + u < nk) {
          const int64_t p = k0 + j + u;
          const int64_t slot = table[p / block_size] * block_size + p % block_size;
          std::memcpy(kt.data() + (j + u) * dh, kh + slot * d, d * 2);
          vr[u] = vh + slot * d;
        } else {
          std::memset(kt.data() + (j + u) * dh, 0, d * 2);
          vr[u] = nullptr;
        }
      }
      uint32_t* vp = vt.data() + (j / 2) * d;
      for (int64_t e = 0; e < d; e += 32) {
        const __m512i a = vr[0] ? _mm512_loadu_si512(vr[0] + e) : _mm512_setzero_si512();
        const __m512i c = vr[1] ? _mm512_loadu_si512(vr[1] + e) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + e, _mm512_permutex2var_epi16(a, lo_idx, c));
        _mm512_storeu_si512(vp + e + 16, _mm512_permutex2var_epi16(a, hi_idx, c));
      }
    }
    for (int64_t rv0 = 0, R; rv0 < nrv; rv0 += R) {
      R = row_block(nrv - rv0);
      int64_t js, je;
      tile_rows(tr, rows, rv0, R, k0, nk, window, scale, softcap, b.m.data(), js, je);
      if (je <= js) continue;
      if (R == 3) {
        bf16_rows<3>(b, qt.data(), kt.data(), vt.data(), d, rv0, tr, js, je);
      } else if (R == 2) {
        bf16_rows<2>(b, qt.data(), kt.data(), vt.data(), d, rv0, tr, js, je);
      } else {
        bf16_rows<1>(b, qt.data(), kt.data(), vt.data(), d, rv0, tr, js, je);
      }
    }
  }
  for (int64_t rv = 0; rv < nrv; ++rv)
    lanes_to_rows<at::BFloat16>(
        b.ot.data() + rv * d * 16, b.l.data() + rv * 16, rows.count(rv), d,
        reinterpret_cast<at::BFloat16*>(out) + ((qstart + rows.first + rv / group * 16) * heads + hk * group + rv % group) * d,
        heads * d);
}

#endif

template <typename T>
void prefill_rows(const T* q, const T* kc, const T* vc, T* out, const int64_t* starts, const int64_t* lens,
                  const int64_t* contexts, const int64_t* tables, int64_t table_width, int64_t heads,
                  int64_t kv_heads, int64_t d, int64_t block_size, int64_t head_slots, int64_t q_row, int64_t q_head,
                  float scale, int64_t window, float softcap, const std::vector<Task>& tasks) {
  const int64_t group = heads / kv_heads;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (d % 32 == 0 && q_row % 2 == 0 && q_head % 2 == 0 && bf16_dot_supported()) {
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
        Scratch b;
        std::vector<uint32_t> qt, kt, vt;
        for (int64_t ti = begin; ti < end; ++ti) {
          const Task& task = tasks[ti];
          const int64_t c = task.chunk;
          const Rows rows{contexts[c], task.first, std::min(QB, lens[c] - task.first), group};
          bf16_dot_task(reinterpret_cast<const uint16_t*>(q),
                        reinterpret_cast<const uint16_t*>(kc) + task.head * head_slots * d,
                        reinterpret_cast<const uint16_t*>(vc) + task.head * head_slots * d,
                        reinterpret_cast<uint16_t*>(out), tables + c * table_width, starts[c], rows, heads, task.head,
                        d, block_size, q_row, q_head, scale, window, softcap, b, qt, kt, vt);
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch b;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = tasks[ti];
      const int64_t c = task.chunk;
      const Rows rows{contexts[c], task.first, std::min(QB, lens[c] - task.first), group};
      f32_task<T>(q, kc + task.head * head_slots * d, vc + task.head * head_slots * d, out, tables + c * table_width,
                  starts[c], rows, heads, task.head, d, block_size, q_row, q_head, scale, window, softcap, b);
    }
  });
}

}  // namespace
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& contexts,
                             const at::Tensor& block_tables, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, heads, head_dim] with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "caches must be contiguous [Hkv, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "dtype mismatch");
  for (const at::Tensor* t : {&starts, &lens, &contexts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->numel() == starts.numel(),
                "starts/lens/contexts must be int64 vectors of one length");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == starts.numel(), "block_tables must be int64 [chunks, blocks]");
  const int64_t kv_heads = k_cache.size(0), d = k_cache.size(3), bs = k_cache.size(2);
  TORCH_CHECK(q.size(2) == d && q.size(1) % kv_heads == 0, "q heads must be a multiple of the KV heads");
  const int64_t chunks = starts.numel();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* cx = contexts.data_ptr<int64_t>();
  std::vector<Task> tasks;
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(st[c] >= 0 && ln[c] >= 1 && st[c] + ln[c] <= q.size(0) && cx[c] >= 0, "chunk ", c, " out of range");
    TORCH_CHECK((cx[c] + ln[c] + bs - 1) / bs <= block_tables.size(1), "chunk ", c, "'s block table is too short");
    // Heavy (late) and light (early) query blocks alternate, so threads taking halves of the list balance;
    // a head's blocks follow each other, so its keys and values stay in cache from one to the next.
    const int64_t nb = (ln[c] + QB - 1) / QB;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < nb; ++i) tasks.push_back({c, h, (i % 2 == 0 ? nb - 1 - i / 2 : i / 2) * QB});
  }
  auto out = at::zeros({q.size(0), q.size(1), d}, q.options());
  const int64_t head_slots = k_cache.size(1) * bs;
  AT_DISPATCH_SWITCH(q.scalar_type(), "prefill_attention",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        prefill_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               out.data_ptr<scalar_t>(), st, ln, cx, block_tables.data_ptr<int64_t>(),
                               block_tables.size(1), q.size(1), kv_heads, d, bs, head_slots, q.stride(0),
                               q.stride(1), scale, window, softcap, tasks);
      }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
        prefill_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               out.data_ptr<scalar_t>(), st, ln, cx, block_tables.data_ptr<int64_t>(),
                               block_tables.size(1), q.size(1), kv_heads, d, bs, head_slots, q.stride(0),
                               q.stride(1), scale, window, softcap, tasks);
      }) AT_DISPATCH_CASE(at::kHalf, [&] {
        prefill_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               out.data_ptr<scalar_t>(), st, ln, cx, block_tables.data_ptr<int64_t>(),
                               block_tables.size(1), q.size(1), kv_heads, d, bs, head_slots, q.stride(0),
                               q.stride(1), scale, window, softcap, tasks);
      }));
  return out;
}

}  // namespace tapllm

#define TAPLLM_PREFILL_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TAPLLM_PREFILL_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TAPLLM_PREFILL_FRAGMENT(TAPLLM_NS, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor starts, Tensor lens, Tensor contexts, "
        "Tensor block_tables, float scale, int window, float softcap) -> Tensor");
}

TAPLLM_PREFILL_IMPL(TAPLLM_NS, CPU, m) { m.impl("prefill_attention", &tapllm::prefill_attention); }
