// The prefill attention task of bfloat16 rows with AVX512-BF16 dot products (vdpbf16ps: 32 products
// summed pairwise into 16 float32 lanes per instruction, twice the FMA rate); the tiling and the
// online softmax are prefill_attention.h's. Only the AVX512 build compiles it.
//
// Q.K sums pairs of dimensions: q^T is stored as [d/2][rows] pairs and a key's pair (adjacent in
// the cache row) broadcast. P.V sums pairs of keys: the value tile is [KT/2][d] pairs of rows and
// the probabilities are rounded to bfloat16 pairs first, as PyTorch's own bf16 attention does.
// Scores, softmax and accumulators are float32.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "prefill_attention.h"
#include "vec_math.h"

#if defined(CPU_CAPABILITY_AVX512)
namespace tapllm {
namespace prefill {
namespace {

template <int R>
TAPLLM_TARGET_AVX512BF16
inline void scores_bf16(const uint32_t* qt, int64_t dh, const uint32_t* kt, float* s, TileRows& tr, int64_t j0) {
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

template <int R>
TAPLLM_TARGET_AVX512BF16
inline void values_bf16(const uint32_t* pp, const uint32_t* vt, int64_t d, int64_t jps, int64_t jpe, const float* alpha,
                        float* ot) {
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
TAPLLM_TARGET_AVX512BF16
void bf16_rows(Scratch& b, const uint32_t* qt, const uint32_t* kt, const uint32_t* vt, int64_t d, int64_t rv0,
               TileRows& tr, int64_t js, int64_t je) {
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

}  // namespace

TAPLLM_TARGET_AVX512BF16
void bf16_dot_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out, const int64_t* table,
                   int64_t qstart, const Rows& rows, int64_t heads, int64_t hk, int64_t d, int64_t block_size,
                   int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap, Scratch& b,
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
  const int64_t last_pos = rows.ctx + rows.first + rows.n - 1;
  const int64_t first_key = first_tile(rows.ctx + rows.first, window);
  TileRows tr;
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
    const int64_t nk = std::min(KT, last_pos + 1 - k0);
    for (int64_t j = 0; j < KT; j += 2) {
      const uint16_t* vr[2];
      for (int u = 0; u < 2; ++u) {
        if (j + u < nk) {
          const int64_t p = k0 + j + u;
          const int64_t slot = paged_slot(table, p, block_size);
          std::memcpy(kt.data() + (j + u) * dh, kh + slot * d, d * 2);
          vr[u] = vh + slot * d;
        } else {
          std::memset(kt.data() + (j + u) * dh, 0, d * 2);
          vr[u] = nullptr;
        }
      }
      pair_value_rows(vr[0], vr[1], vt.data() + (j / 2) * d, d);
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

}  // namespace prefill
}  // namespace tapllm
#endif
