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
//
// The shared parts live here: the tiling, which keys a row vector sees, the online softmax's
// rescaling and the moves between rows and lanes. prefill_attention.cpp has the float32 task
// (every dtype) and the op; prefill_attention_bf16.cpp the task with AVX512-BF16 dot products.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace tapllm {
namespace prefill {

constexpr int64_t KT = 64;  // keys per tile
constexpr int64_t QB = 64;  // query positions per task (a multiple of W)
constexpr int J = 8;        // keys (scores) or output dimensions (values) per register block
#if defined(CPU_CAPABILITY_AVX512)
constexpr int RMAX = 3;     // row vectors per register block: 3 x 8 accumulators of 32 zmm
#else
constexpr int RMAX = 1;     // 16 ymm registers
#endif
constexpr float kLog2e = 1.4426950408889634f;

// The first key tile a query at position pos reads: tiles start at multiples of KT, wherever the
// query's chunk starts, so every row meets the same tiles (and the same online-softmax rescalings)
// in any chunk, and row_attention.cpp can repeat them for a query alone.
inline int64_t first_tile(int64_t pos, int64_t window) {
  return (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) / KT * KT;
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

#if defined(CPU_CAPABILITY_AVX512)
// The probabilities of keys [js, je) as bfloat16 pairs pp[r][j / 2][rows]; m, l and alpha updated (the
// AVX512-BF16 and the AMX task).
template <bool Masked>
TAPLLM_TARGET_AVX512BF16
inline void softmax_bf16(const float* s, uint32_t* pp, int R, int64_t rv0, const TileRows& tr, int64_t js, int64_t je,
                         float* m, float* l, float* alpha) {
  // word 2i of a pair from lane i of the first key, word 2i + 1 from the second key
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int r = 0; r < R; ++r) {
    const float* sr = s + r * KT * 16;
    const Vec mc = rescale(tr, r, m + (rv0 + r) * 16, alpha + r * 16);
    Vec sum0(0.f), sum1(0.f);
    for (int64_t j = js; j < je; j += 2) {
      const Vec e0 = exp2_neg<Masked>(at::vec::fmsub(Vec::loadu(sr + j * 16), Vec(tr.cscale), mc));
      const Vec e1 = exp2_neg<Masked>(at::vec::fmsub(Vec::loadu(sr + (j + 1) * 16), Vec(tr.cscale), mc));
      sum0 = sum0 + e0;
      sum1 = sum1 + e1;
      const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
      _mm512_storeu_si512(pp + (r * KT / 2 + j / 2) * 16, _mm512_permutexvar_epi16(inter, two));
    }
    float* lr = l + (rv0 + r) * 16;
    at::vec::fmadd(Vec::loadu(lr), Vec::loadu(alpha + r * 16), sum0 + sum1).store(lr);
  }
}

// The value rows of keys 2jp and 2jp + 1 as one row of pairs (word 2i from a, word 2i + 1 from c, for
// each of the d dimensions): the B operand of P.V by key pairs. A null row reads as zeros.
inline void pair_value_rows(const uint16_t* a, const uint16_t* c, uint32_t* row, int64_t d) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t e = 0; e < d; e += 32) {
    const __m512i x = a ? _mm512_loadu_si512(a + e) : _mm512_setzero_si512();
    const __m512i y = c ? _mm512_loadu_si512(c + e) : _mm512_setzero_si512();
    _mm512_storeu_si512(row + e, _mm512_permutex2var_epi16(x, lo_idx, y));
    _mm512_storeu_si512(row + e + 16, _mm512_permutex2var_epi16(x, hi_idx, y));
  }
}

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

#if defined(CPU_CAPABILITY_AVX512)
// One task of bfloat16 rows with AVX512-BF16 dot products (prefill_attention_bf16.cpp); call only
// where bf16_dot_supported(), for head sizes of a multiple of 32.
TAPLLM_TARGET_AVX512BF16
void bf16_dot_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out, const int64_t* table,
                   int64_t qstart, const Rows& rows, int64_t heads, int64_t hk, int64_t d, int64_t block_size,
                   int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap, Scratch& b,
                   std::vector<uint32_t>& qt, std::vector<uint32_t>& kt, std::vector<uint32_t>& vt);

// The same task with AMX tile products (amx_attention.cpp); call only where amx_supported(), for head
// sizes of a multiple of 32, between amx_begin() and amx_end() on the calling thread (its tile
// configuration, then the tiles handed back).
void amx_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out, const int64_t* table,
              int64_t qstart, const Rows& rows, int64_t heads, int64_t hk, int64_t d, int64_t block_size,
              int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap, Scratch& b,
              std::vector<uint32_t>& qt, std::vector<uint32_t>& kt, std::vector<uint32_t>& vt);
void amx_begin();
void amx_end();
#endif

}  // namespace prefill
}  // namespace tapllm
