// Decode attention (decode_attention): one query per sequence, K/V read in place from their blocks.
//
// Each task is one (sequence, KV head): the G query heads that share the KV head read its key
// and value rows (from L1/L2 after the first head). Scores, softmax and the weighted sum are
// computed in float32. NV (vectors per head row) is a template constant for the common head
// sizes so a head's query and accumulator stay in registers; 0 means "at run time".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "checks.h"
#include "kernels.h"
#include "vec_math.h"

namespace tapllm {
namespace {

// Scores [0, n) soft-capped (when softcap > 0) and replaced by exp(score - max), in place;
// returns their sum (the softmax's denominator).
inline float exp_scores(float* sg, int64_t n, float softcap) {
  int64_t i = 0;
  if (softcap > 0.f) {
    const Vec cap(softcap), inv(1.f / softcap);
    for (; i + W <= n; i += W) ((Vec::loadu(sg + i) * inv).tanh() * cap).store(sg + i);
    for (; i < n; ++i) sg[i] = std::tanh(sg[i] / softcap) * softcap;
  }
  float mx = -std::numeric_limits<float>::infinity();
  Vec vmax(mx);
  for (i = 0; i + W <= n; i += W) vmax = at::vec::maximum(vmax, Vec::loadu(sg + i));
  for (; i < n; ++i) mx = std::max(mx, sg[i]);
  mx = std::max(mx, at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax));
  Vec vmx(mx), vsum(0.f);
  float sum = 0.f;
  for (i = 0; i + W <= n; i += W) {
    const Vec e = (Vec::loadu(sg + i) - vmx).exp();
    e.store(sg + i);
    vsum = vsum + e;
  }
  for (; i < n; ++i) {
    sg[i] = std::exp(sg[i] - mx);
    sum += sg[i];
  }
  return sum + at::vec::vec_reduce_all<float>(std::plus<Vec>(), vsum);
}

#if defined(CPU_CAPABILITY_AVX512)
// Lane j of the result is the sum of the 16 lanes of a[j]: a transpose-and-add tree of 45
// shuffles and adds, where 16 separate horizontal sums take about three times as many.
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// Keys of a 16-key chunk: the chunk kKeysAhead on into L2, the next chunk from L2 into L1. One
// distance into L1 alone bounds the requests in flight by L1's miss buffers, which on scattered
// blocks (every 16 keys a new 2-4 KB run) leaves the memory far from its bandwidth; a second,
// longer distance into L2 keeps more requests in flight.
constexpr int64_t kKeysAhead = 48;
template <typename T>
inline void prefetch_keys(const T* kh, const int64_t* table, int64_t p0, int64_t len, int64_t block_size, int64_t d) {
  prefetch_rows<T, _MM_HINT_T1>(kh, table, p0 + kKeysAhead, std::min<int64_t>(len, p0 + kKeysAhead + 16), block_size, d);
  prefetch_rows(kh, table, p0 + 16, std::min<int64_t>(len, p0 + 32), block_size, d);
}
// What prefetch_keys would have requested before the task's first chunk.
template <typename T>
inline void prefetch_first_keys(const T* kh, const int64_t* table, int64_t first, int64_t len, int64_t block_size,
                                int64_t d) {
  prefetch_rows<T, _MM_HINT_T1>(kh, table, first, std::min<int64_t>(len, first + kKeysAhead), block_size, d);
  prefetch_rows(kh, table, first, std::min<int64_t>(len, first + 16), block_size, d);
}

// Scores of every query head of the group against keys [first, len), 16 keys at a time: each key
// row is widened once for the group, and the 16 dot products of a head are summed by sum16.
template <typename T, int NV>
void decode_scores16(const T* q, const T* kh, const T* vh, const int64_t* table, int64_t first, int64_t len, int64_t group,
                     int64_t block_size, int64_t q_head, float scale, float* scores) {
  constexpr int64_t D = NV * 16;
  const int64_t n = len - first;
  alignas(64) float kbuf[std::is_same_v<T, float> ? 1 : 16 * D];
  prefetch_first_keys(kh, table, first, len, block_size, D);
  for (int64_t p0 = first; p0 < len; p0 += 16) {
    const int64_t nk = std::min<int64_t>(16, len - p0);
    prefetch_keys(kh, table, p0, len, block_size, D);
    // the values of these keys into L2 now, as decode_scores_dot does
    prefetch_rows<T, _MM_HINT_T1>(vh, table, p0, p0 + nk, block_size, D);
    const float* rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t p = p0 + std::min<int64_t>(j, nk - 1);  // past the end: repeat the last key, not stored
      const T* krow = kh + (paged_slot(table, p, block_size)) * D;
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = krow;
      } else {
        for (int v = 0; v < NV; ++v) loadf<T>(krow + v * 16).store(kbuf + j * D + v * 16);
        rows[j] = kbuf + j * D;
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nk) - 1);
    for (int64_t g = 0; g < group; ++g) {
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_mul_ps(loadf<T>(q + g * q_head + v * 16), _mm512_set1_ps(scale));
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(rows[j]), qv[0]);
        for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(rows[j] + v * 16), qv[v], a);
        acc[j] = a;
      }
      _mm512_mask_storeu_ps(scores + g * n + (p0 - first), keep, sum16(acc));
    }
  }
}

// The whole task with the keys outermost: scores by decode_scores16, a float32 softmax per head,
// then each value row is widened once and added into the accumulators of up to four heads.
template <typename T, int NV>
void decode_task16(const T* q, const T* kh, const T* vh, T* out, const int64_t* table, int64_t first, int64_t len,
                   int64_t group, int64_t block_size, int64_t q_head, float scale, float softcap, float* scores) {
  constexpr int64_t D = NV * 16;
  constexpr int HP = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);  // heads per pass over the values (accumulators in registers)
  const int64_t n = len - first;
  decode_scores16<T, NV>(q, kh, vh, table, first, len, group, block_size, q_head, scale, scores);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    const float sum = exp_scores(sg, n, softcap);
    int64_t i = 0;
    const Vec norm(1.f / sum);
    for (i = 0; i + W <= n; i += W) (Vec::loadu(sg + i) * norm).store(sg + i);
    for (; i < n; ++i) sg[i] *= 1.f / sum;
  }
  // heads [g0, g0 + HPN) over every value row, the head count a compile-time constant
  auto pass = [&](auto hp_tag, int64_t g0) {
    constexpr int HPN = decltype(hp_tag)::value;
    __m512 av[HPN][NV];
    for (int h = 0; h < HPN; ++h)
      for (int v = 0; v < NV; ++v) av[h][v] = _mm512_setzero_ps();
    if (g0 == 0) prefetch_rows(vh, table, first, std::min<int64_t>(len, first + 48), block_size, D);
    for (int64_t p = first; p < len; ++p) {
      if (g0 == 0 && (p - first) % 16 == 0) prefetch_rows(vh, table, p + 48, std::min<int64_t>(len, p + 64), block_size, D);
      const T* vrow = vh + (paged_slot(table, p, block_size)) * D;
      __m512 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = loadf<T>(vrow + v * 16);
      for (int h = 0; h < HPN; ++h) {
        const __m512 w = _mm512_set1_ps(scores[(g0 + h) * n + (p - first)]);
        for (int v = 0; v < NV; ++v) av[h][v] = _mm512_fmadd_ps(w, vv[v], av[h][v]);
      }
    }
    for (int h = 0; h < HPN; ++h)
      for (int v = 0; v < NV; ++v) storef<T>(out + (g0 + h) * D + v * 16, Vec(av[h][v]));
  };
  for (int64_t g0 = 0; g0 < group; g0 += HP) {
    switch (std::min<int64_t>(HP, group - g0)) {
      case 1: pass(std::integral_constant<int, 1>(), g0); break;
      case 2: if constexpr (HP >= 2) pass(std::integral_constant<int, 2>(), g0); break;
      case 3: if constexpr (HP >= 3) pass(std::integral_constant<int, 3>(), g0); break;
      default: if constexpr (HP >= 4) pass(std::integral_constant<int, 4>(), g0); break;
    }
  }
}

// bfloat16 K/V with AVX512-BF16 dot products, for head sizes of DP x 32. In the float32 task above
// widening every key and value row costs as much as the products (a bf16 step is compute-bound even
// in cache). Q.K: a key row's pairs of dimensions times the query's, 16 keys summed by sum16. P.V:
// pairs of keys: the two value rows interleaved (vpunpck{l,h}wd, so lanes hold dims in a fixed
// permuted order, undone at the end) times the two probabilities rounded to bfloat16, as PyTorch's
// bf16 attention rounds them. Scores, softmax and sums are float32.
template <int DP>
TAPLLM_TARGET_AVX512BF16
void decode_scores_dot(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int64_t* table, int64_t first,
                       int64_t len, int64_t group, int64_t block_size, int64_t q_head, float scale, float* scores) {
  constexpr int64_t D = DP * 32;
  const int64_t n = len - first;
  prefetch_first_keys(kh, table, first, len, block_size, D);
  for (int64_t p0 = first; p0 < len; p0 += 16) {
    const int64_t nk = std::min<int64_t>(16, len - p0);
    prefetch_keys(kh, table, p0, len, block_size, D);
    // the values of these keys into L2 now: the value pass then misses only there, and the memory
    // has twice the requests in flight while the keys are scored
    prefetch_rows<uint16_t, _MM_HINT_T1>(vh, table, p0, p0 + nk, block_size, D);
    const uint16_t* rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t p = p0 + std::min<int64_t>(j, nk - 1);  // past the end: repeat the last key, not stored
      rows[j] = kh + (paged_slot(table, p, block_size)) * D;
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nk) - 1);
    for (int64_t g = 0; g < group; ++g) {
      __m512bh qv[DP];
      for (int v = 0; v < DP; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(q + g * q_head + v * 32);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(rows[j]), qv[0]);
        for (int v = 1; v < DP; ++v) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(rows[j] + v * 32), qv[v]);
        acc[j] = a;
      }
      _mm512_mask_storeu_ps(scores + g * n + (p0 - first), keep, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
  }
}

// Heads [g0, g0 + HPN) of a task over every value pair (a function, not a lambda: a lambda
// does not take the target attribute).
template <int DP, int HPN>
TAPLLM_TARGET_AVX512BF16
void dot_values(const uint16_t* vh, uint16_t* out, const int64_t* table, int64_t first, int64_t len, int64_t block_size,
                const uint16_t* probs, int64_t np, int64_t g0) {
  constexpr int64_t D = DP * 32;
  __m512 lo[HPN][DP], hi[HPN][DP];
  for (int h = 0; h < HPN; ++h)
    for (int v = 0; v < DP; ++v) lo[h][v] = hi[h][v] = _mm512_setzero_ps();
  if (g0 == 0) prefetch_rows(vh, table, first, std::min<int64_t>(len, first + 48), block_size, D);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t p = first + 2 * i, p1 = std::min(p + 1, len - 1);
    if (g0 == 0 && i % 8 == 0) prefetch_rows(vh, table, p + 48, std::min<int64_t>(len, p + 64), block_size, D);
    const uint16_t* a = vh + (paged_slot(table, p, block_size)) * D;
    const uint16_t* b = vh + (paged_slot(table, p1, block_size)) * D;
    __m512i vl[DP], vu[DP];
    for (int v = 0; v < DP; ++v) {
      const __m512i x = _mm512_loadu_si512(a + v * 32), y = _mm512_loadu_si512(b + v * 32);
      vl[v] = _mm512_unpacklo_epi16(x, y);
      vu[v] = _mm512_unpackhi_epi16(x, y);
    }
    for (int h = 0; h < HPN; ++h) {
      uint32_t bits;
      std::memcpy(&bits, probs + (g0 + h) * 2 * np + 2 * i, 4);
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
      for (int v = 0; v < DP; ++v) {
        lo[h][v] = _mm512_dpbf16_ps(lo[h][v], (__m512bh)vl[v], w);
        hi[h][v] = _mm512_dpbf16_ps(hi[h][v], (__m512bh)vu[v], w);
      }
    }
  }
  // lane e of lo[v] holds dim 32v + 8 (e / 4) + e % 4, of hi[v] the same + 4
  for (int h = 0; h < HPN; ++h) {
    alignas(64) float l[16], u[16], o[D];
    for (int v = 0; v < DP; ++v) {
      _mm512_store_ps(l, lo[h][v]);
      _mm512_store_ps(u, hi[h][v]);
      for (int e = 0; e < 16; ++e) {
        o[32 * v + 8 * (e / 4) + e % 4] = l[e];
        o[32 * v + 8 * (e / 4) + e % 4 + 4] = u[e];
      }
    }
    for (int v = 0; v < 2 * DP; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g0 + h) * D + v * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(o + v * 16)));
  }
}

template <int DP>
TAPLLM_TARGET_AVX512BF16
void decode_task_dot(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out, const int64_t* table,
                     int64_t first, int64_t len, int64_t group, int64_t block_size, int64_t q_head, float scale,
                     float softcap, float* scores, uint16_t* probs) {
  constexpr int HP = DP <= 2 ? 4 : (DP <= 4 ? 2 : 1);  // heads per pass: 2 x DP accumulators each
  const int64_t n = len - first, np = (n + 1) / 2;  // key pairs; an odd count's last pair has weight 0
  decode_scores_dot<DP>(q, kh, vh, table, first, len, group, block_size, q_head, scale, scores);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    const float inv = 1.f / exp_scores(sg, n, softcap);
    uint16_t* pg = probs + g * 2 * np;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sg + i), _mm512_set1_ps(inv))));
    if (i < 2 * np) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sg + i), _mm512_set1_ps(inv));  // zero past n
      _mm256_mask_storeu_epi16(pg + i, static_cast<__mmask16>((1u << (2 * np - i)) - 1), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
  for (int64_t g0 = 0; g0 < group; g0 += HP) {
    switch (std::min<int64_t>(HP, group - g0)) {
      case 1: dot_values<DP, 1>(vh, out, table, first, len, block_size, probs, np, g0); break;
      case 2: if constexpr (HP >= 2) dot_values<DP, 2>(vh, out, table, first, len, block_size, probs, np, g0); break;
      case 3: if constexpr (HP >= 3) dot_values<DP, 3>(vh, out, table, first, len, block_size, probs, np, g0); break;
      default: if constexpr (HP >= 4) dot_values<DP, 4>(vh, out, table, first, len, block_size, probs, np, g0); break;
    }
  }
}
#endif

template <typename T, int NV>
void decode_task(const T* q, const T* kh, const T* vh, T* out, const int64_t* table, int64_t first, int64_t len,
                 int64_t group, int64_t d, int64_t block_size, int64_t q_head, float scale, float softcap,
                 float* scores, float* qf, float* acc) {
  const int64_t nv = NV > 0 ? NV : d / W;
  const int64_t n = len - first;
  for (int64_t g = 0; g < group; ++g) {
    const T* qs = q + g * q_head;
    for (int64_t j = 0; j < d; ++j) qf[j] = static_cast<float>(qs[j]) * scale;
    float* sg = scores + g * n;
    Vec qv[NV > 0 ? NV : 1];
    if constexpr (NV > 0)
      for (int v = 0; v < NV; ++v) qv[v] = Vec::loadu(qf + v * W);
    for (int64_t p = first; p < len; ++p) {
      const T* krow = kh + (paged_slot(table, p, block_size)) * d;
      Vec a(0.f);
      for (int64_t v = 0; v < nv; ++v)
        a = at::vec::fmadd(loadf<T>(krow + v * W), NV > 0 ? qv[NV > 0 ? v : 0] : Vec::loadu(qf + v * W), a);
      float sc = at::vec::vec_reduce_all<float>(std::plus<Vec>(), a);
      for (int64_t j = nv * W; j < d; ++j) sc += static_cast<float>(krow[j]) * qf[j];
      sg[p - first] = sc;
    }
    const float sum = exp_scores(sg, n, softcap);
    const float norm = 1.f / sum;
    Vec av[NV > 0 ? NV : 1];
    if constexpr (NV > 0) {
      for (int v = 0; v < NV; ++v) av[v] = Vec(0.f);
    } else {
      std::fill(acc, acc + d, 0.f);
    }
    for (int64_t p = first; p < len; ++p) {
      const T* vrow = vh + (paged_slot(table, p, block_size)) * d;
      const float w = sg[p - first];
      const Vec vw(w);
      if constexpr (NV > 0) {
        for (int v = 0; v < NV; ++v) av[v] = at::vec::fmadd(vw, loadf<T>(vrow + v * W), av[v]);
      } else {
        int64_t j = 0;
        for (; j + W <= d; j += W) at::vec::fmadd(vw, loadf<T>(vrow + j), Vec::loadu(acc + j)).store(acc + j);
        for (; j < d; ++j) acc[j] += w * static_cast<float>(vrow[j]);
      }
    }
    T* o = out + g * d;
    if constexpr (NV > 0) {
      for (int v = 0; v < NV; ++v) storef<T>(o + v * W, av[v] * Vec(norm));
    } else {
      for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[j] * norm);
    }
  }
}

template <typename T>
void decode_rows(const T* q, const T* kc, const T* vc, T* out, const int64_t* tables, const int64_t* lens,
                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t head_slots,
                 int64_t table_width, int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap) {
  const int64_t group = heads / kv_heads;
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b]);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if ((d == 64 || d == 128 || d == 256) && q_head % 2 == 0 && q_row % 2 == 0 && bf16_dot_supported()) {
      auto run_dot = [&](auto dp_tag) {
        constexpr int DP = decltype(dp_tag)::value;
        at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
          const int64_t longest_even = std::max<int64_t>(longest, 1) + 1;
          std::vector<float> scores(group * longest_even);
          std::vector<uint16_t> probs(group * longest_even);
          for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / kv_heads, hk = task % kv_heads;
            const int64_t len = lens[b];
            const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            const auto* qb = reinterpret_cast<const uint16_t*>(q) + b * q_row + hk * group * q_head;
            decode_task_dot<DP>(qb, reinterpret_cast<const uint16_t*>(kc) + hk * head_slots * d,
                                reinterpret_cast<const uint16_t*>(vc) + hk * head_slots * d,
                                reinterpret_cast<uint16_t*>(out) + (b * heads + hk * group) * d,
                                tables + b * table_width, first, len, group, block_size, q_head, scale, softcap,
                                scores.data(), probs.data());
          }
        });
      };
      if (d == 64) run_dot(std::integral_constant<int, 2>());
      else if (d == 128) run_dot(std::integral_constant<int, 4>());
      else run_dot(std::integral_constant<int, 8>());
      return;
    }
  }
#endif
  auto run = [&](auto nv_tag) {
    constexpr int NV = decltype(nv_tag)::value;
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(group * std::max<int64_t>(longest, 1)), qf(d), acc(d);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / kv_heads, hk = task % kv_heads;
        const int64_t len = lens[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (NV > 0) {
          decode_task16<T, NV>(q + b * q_row + hk * group * q_head, kc + hk * head_slots * d,
                               vc + hk * head_slots * d, out + (b * heads + hk * group) * d, tables + b * table_width,
                               first, len, group, block_size, q_head, scale, softcap, scores.data());
          continue;
        }
#endif
        decode_task<T, NV>(q + b * q_row + hk * group * q_head, kc + hk * head_slots * d, vc + hk * head_slots * d,
                           out + (b * heads + hk * group) * d, tables + b * table_width, first, len, group, d,
                           block_size, q_head, scale, softcap, scores.data(), qf.data(), acc.data());
      }
    });
  };
  const bool exact = d % W == 0;
  switch (exact ? d / W : 0) {
    case 2: run(std::integral_constant<int, 2>()); break;
    case 4: run(std::integral_constant<int, 4>()); break;
    case 5: run(std::integral_constant<int, 5>()); break;
    case 6: run(std::integral_constant<int, 6>()); break;
    case 8: run(std::integral_constant<int, 8>()); break;
    case 10: run(std::integral_constant<int, 10>()); break;
    case 12: run(std::integral_constant<int, 12>()); break;
    case 16: run(std::integral_constant<int, 16>()); break;
    default: run(std::integral_constant<int, 0>()); break;
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                            double softcap) {
  check_heads(q, "q");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == q.size(0), "block_tables must be int64 [B, blocks]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == q.size(0), "bad lens");
  const int64_t kv_heads = k_cache.size(0), d = k_cache.size(3);
  TORCH_CHECK(q.size(2) == d && q.size(1) % kv_heads == 0, "q heads must be a multiple of the KV heads");
  const int64_t bs = k_cache.size(2), blocks = k_cache.size(1);
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t* tb = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(ln[b] >= 0 && (ln[b] + bs - 1) / bs <= block_tables.size(1), "sequence ", b, "'s block table is too short");
    for (int64_t j = 0; j < (ln[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tb[b * block_tables.size(1) + j] >= 0 && tb[b * block_tables.size(1) + j] < blocks, "sequence ", b,
                  " names block ", tb[b * block_tables.size(1) + j], " of a cache of ", blocks);
  }
  auto out = at::empty({q.size(0), q.size(1), d}, q.options());
  const int64_t head_slots = k_cache.size(1) * k_cache.size(2);
  TAPLLM_DISPATCH(q.scalar_type(), "decode_attention", [&] {
    decode_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                          q.size(0), q.size(1), kv_heads, d, k_cache.size(2), head_slots, block_tables.size(1),
                          q.stride(0), q.stride(1), scale, window, softcap);
  });
  return out;
}

}  // namespace tapllm
