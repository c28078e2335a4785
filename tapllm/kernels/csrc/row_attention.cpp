// Attention of one query row per sequence (a decode step) in exactly the arithmetic the prefill
// kernel gives each of its rows (row_attention), for batch_invariant=True: a token's attention is
// then bitwise the same whether its row was attended inside a prefill chunk or alone in a decode
// step, whatever else the step held.
//
// The prefill kernel (prefill_attention.h) keeps one query position per vector lane, so each row's
// arithmetic is a fixed scalar sequence: key tiles of KT starting at multiples of KT (first_tile),
// per tile the scores as chains of products over the head's dimensions in order, the online
// softmax's rescaling (the same exp2 polynomial), the exponentials summed into two partial sums
// (even and odd keys of the tile), the values accumulated key by key; keys a row does not see add
// exact zeros. Here one row is computed at a time with the lanes over keys (scores) or dimensions
// (values), every step repeating those operations with the same operands, in the same order.
// The Python side (tapllm/kernels/invariance.py) checks the two kernels agree bit for bit before
// batch_invariant uses them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "kernels.h"
#include "prefill_attention.h"
#include "vec_math.h"

namespace tapllm {
namespace prefill {
namespace {

constexpr int64_t KC = KT / W;  // vectors of keys per tile
constexpr int kScoreHeads = KC >= 16 ? 1 : static_cast<int>(std::min<int64_t>(4, 16 / KC));  // heads per scores pass
const float kNegInf = -std::numeric_limits<float>::infinity();

inline float lane0(const Vec& v) {
  alignas(64) float t[W];
  v.store(t);
  return t[0];
}

// A tile buffer of at least n elements. Its rows are written before they are read within a tile, except
// the scores of key vectors a row does not reach, which nothing reads: no zeroing per task.
template <typename V>
inline void grow(std::vector<V>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.assign(n, V(0));
}

// Per-thread buffers of one row task.
struct RowScratch {
  std::vector<float> qf, kw, kt, vw, s, ot, m, l, alpha, sum;
  std::vector<uint32_t> qp, kp, ktp, vt;
  std::vector<uint16_t> pb;
  std::vector<int64_t> offs;  // per tile of a pass: element offsets of its keys [a, e) in a head's cache (Tile::rows)
  int64_t off[KT];  // the same for one tile (the float32 task)
};

// A row's part of the key tile at k0: the keys [a, e) it sees; [c0, c1) (relative to k0) the vectors
// of `width` keys that hold them.
struct Tile {
  int64_t k0, a, e, c0, c1;
  Tile(int64_t k0_, int64_t lo, int64_t pos, int64_t width) : k0(k0_) {
    a = std::max(k0, lo);
    e = std::min(k0 + KT, pos + 1);
    c0 = (a - k0) / width * width;
    c1 = (e - k0 + width - 1) / width * width;
  }
  bool empty() const { return e <= a; }  // a tile before the row's window leaves its state as it is

  // off[j - k0] = where key j's row (of d elements) starts in a head's cache, for the keys [a, e): one
  // division per block the tile touches, not one per key and pass (K and V share the offsets).
  void rows(const int64_t* table, int64_t block_size, int64_t d, int64_t* off) const {
    for (int64_t j = a; j < e;) {
      const int64_t blk = j / block_size, end = std::min(e, (blk + 1) * block_size);
      const int64_t base = (table[blk] * block_size - blk * block_size) * d;
      for (; j < end; ++j) off[j - k0] = base + j * d;
    }
  }
};

// Scores of W keys from key0 as the prefill kernel's score() leaves them: scaled and soft-capped
// where it transforms them, -inf outside the visible keys [a, e).
inline Vec transform(Vec x, bool tf, float scale, float softcap, int64_t key0, int64_t a, int64_t e) {
  if (tf) {
    x = x * Vec(scale);
    if (softcap > 0.f) x = (x * Vec(1.f / softcap)).tanh() * Vec(softcap);
  }
  if (key0 >= a && key0 + W <= e) return x;
  alignas(64) float t[W];
  x.store(t);
  for (int64_t i = 0; i < W; ++i)
    if (key0 + i < a || key0 + i >= e) t[i] = kNegInf;
  return Vec::loadu(t);
}

// The online softmax of every head over the tile's keys, as prefill_attention.h's rescale and the
// softmax steps compute it for the row's lane: s [group][KT] holds the scores (-inf where masked) and
// gets the exponentials; m, l updated, alpha the factor of each head's earlier output. The sums run
// key by key into the prefill kernel's two partial sums (even and odd keys of the tile); keys a row
// does not see add exact zeros there, so they are left out here.
inline void softmax_tile(float* s, int64_t group, const Tile& t, float cscale, float* m, float* l, float* alpha,
                         float* sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * KT;
    Vec vmax(m[g]);
    for (int64_t c = t.c0; c < t.c1; c += W) vmax = at::vec::maximum(vmax, Vec::loadu(sg + c));
    const Vec mxv(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax));
    const Vec mu = Vec::blendv(mxv, Vec(0.f), mxv == Vec(kNegInf));
    alpha[g] = lane0(exp2_neg<true>((Vec(m[g]) - mu) * Vec(cscale)));
    m[g] = lane0(mxv);
    const Vec mc = mu * Vec(cscale);
    for (int64_t c = t.c0; c < t.c1; c += W)
      exp2_neg<true>(at::vec::fmsub(Vec::loadu(sg + c), Vec(cscale), mc)).store(sg + c);
    sum[2 * g] = sum[2 * g + 1] = 0.f;
  }
  for (int64_t j = t.a; j < t.e; ++j) {  // the heads' chains side by side
    const int64_t parity = (j - t.k0) % 2;
    for (int64_t g = 0; g < group; ++g) sum[2 * g + parity] += s[g * KT + j - t.k0];
  }
  for (int64_t g = 0; g < group; ++g)
    l[g] = lane0(at::vec::fmadd(Vec(l[g]), Vec(alpha[g]), Vec(sum[2 * g] + sum[2 * g + 1])));
}

// One head's output row: O / l in T, as lanes_to_rows stores it.
template <typename T>
inline void store_out(const float* ot, float l, int64_t d, T* dst) {
  const float inv = 1.f / l;
#if defined(CPU_CAPABILITY_AVX512)
  for (int64_t e0 = 0; e0 < d; e0 += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, d - e0)) - 1);
    const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(ot + e0), _mm512_set1_ps(inv));
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(dst + e0, mask, r);
    } else if constexpr (std::is_same_v<T, at::BFloat16>) {
      _mm256_mask_storeu_epi16(dst + e0, mask, at::vec::cvtfp32_bf16(r));
    } else {
      _mm256_mask_storeu_epi16(dst + e0, mask, _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
#else
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(ot[i] * inv);
#endif
}

// Keys and values [from, to) into L2 ahead of use (a sequence's blocks lie anywhere: the hardware
// prefetcher does not find them): a task's first tile, while the thread's previous task runs.
template <typename T>
inline void prefetch_keys(const T* kh, const T* vh, const int64_t* table, int64_t from, int64_t to, int64_t block_size,
                          int64_t d) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (from < to) {
    prefetch_rows<T, _MM_HINT_T1>(kh, table, from, to, block_size, d);
    prefetch_rows<T, _MM_HINT_T1>(vh, table, from, to, block_size, d);
  }
#endif
}

// The next tile's key and value rows, requested a few at a time while a tile's scores are computed:
// spread over that phase, the memory has requests in flight all along instead of in one burst.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* table = nullptr;
  int64_t from = 0, to = 0, block_size = 1, row_bytes = 0;

  // Rows [from + i * KT / steps, from + (i + 1) * KT / steps): step i of a loop of `steps`.
  void step(int64_t i, int64_t steps) const {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (k == nullptr) return;
    for (int64_t p = from + i * KT / steps, end = std::min(to, from + (i + 1) * KT / steps); p < end; ++p) {
      const int64_t off = paged_slot(table, p, block_size) * row_bytes;
      for (int64_t b = 0; b < row_bytes; b += 64) {
        _mm_prefetch(k + off + b, _MM_HINT_T1);
        _mm_prefetch(v + off + b, _MM_HINT_T1);
      }
    }
#else
    (void)i;
    (void)steps;
#endif
  }
};

template <typename T>
inline Ahead ahead_of(const T* kh, const T* vh, const int64_t* table, int64_t k0, int64_t pos, int64_t block_size,
                      int64_t d) {
  Ahead a;
  if (k0 + KT <= pos) {
    a.k = reinterpret_cast<const char*>(kh);
    a.v = reinterpret_cast<const char*>(vh);
    a.table = table;
    a.from = k0 + KT;
    a.to = std::min(pos + 1, k0 + 2 * KT);
    a.block_size = block_size;
    a.row_bytes = d * static_cast<int64_t>(sizeof(T));
  }
  return a;
}

// The first tile of a row at pos.
template <typename T>
inline void prefetch_first(const T* kh, const T* vh, const int64_t* table, int64_t pos, int64_t window,
                           int64_t block_size, int64_t d) {
  const int64_t first = first_tile(pos, window), lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  prefetch_keys(kh, vh, table, std::max(first, lo), std::min(pos + 1, first + KT), block_size, d);
}

// ---- the float32 task (every dtype): prefill_attention.cpp's f32_task for one lane ----------------

// Scores of heads [g0, g0 + NH) against the tile's key vectors (transposed: kt [KC][d][W]).
template <int NH>
inline void f32_scores(const float* qf, const float* kt, int64_t d, int64_t g0, float* s, const Ahead& ahead) {
  Vec acc[NH][KC];
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < KC; ++c) acc[h][c] = Vec(0.f);
  for (int64_t x = 0; x < d; ++x) {
    ahead.step(x, d);
    Vec kv[KC];
    for (int64_t c = 0; c < KC; ++c) kv[c] = Vec::loadu(kt + (c * d + x) * W);
    for (int h = 0; h < NH; ++h) {
      const Vec qv(qf[(g0 + h) * d + x]);
      for (int64_t c = 0; c < KC; ++c) acc[h][c] = at::vec::fmadd(qv, kv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < KC; ++c) acc[h][c].store(s + (g0 + h) * KT + c * W);
}

// Outputs of heads [g0, g0 + NH) (NV vectors each): O = alpha O + sum_j p_j v_j over the visible keys.
template <typename T, int NV, int NH>
inline void f32_values(const T* vh, const int64_t* off, const Tile& t, const float* s, const float* alpha, int64_t g0,
                       float* ot) {
  constexpr int64_t D = NV * W;
  Vec acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) acc[h][v] = Vec::loadu(ot + (g0 + h) * D + v * W) * Vec(alpha[g0 + h]);
  for (int64_t j = t.a; j < t.e; ++j) {
    const T* vr = vh + off[j - t.k0];
    Vec vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = loadf<T>(vr + v * W);
    for (int h = 0; h < NH; ++h) {
      const Vec pv(s[(g0 + h) * KT + j - t.k0]);
      for (int v = 0; v < NV; ++v) acc[h][v] = at::vec::fmadd(pv, vv[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) acc[h][v].store(ot + (g0 + h) * D + v * W);
}

// Heads [0, group) in passes of at most MAXH (<= 4): f(std::integral_constant<int, NH>, g0).
template <int MAXH, typename F>
inline void by_heads(int64_t group, F&& f) {
  for (int64_t g0 = 0; g0 < group; g0 += MAXH) {
    switch (std::min<int64_t>(MAXH, group - g0)) {
      case 1: f(std::integral_constant<int, 1>(), g0); break;
      case 2: if constexpr (MAXH >= 2) f(std::integral_constant<int, 2>(), g0); break;
      case 3: if constexpr (MAXH >= 3) f(std::integral_constant<int, 3>(), g0); break;
      default: if constexpr (MAXH >= 4) f(std::integral_constant<int, 4>(), g0); break;
    }
  }
}

// NV > 0: head size NV * W, registers blocked; NV == 0: any head size.
template <typename T, int NV>
void f32_row(const T* q, int64_t q_head, const T* kh, const T* vh, T* out, const int64_t* table, int64_t pos,
             int64_t group, int64_t d, int64_t block_size, float scale, int64_t window, float softcap, RowScratch& b) {
  const int64_t dp = (d + W - 1) / W * W;
  const bool tf = softcap > 0.f || !(scale > 0.f);
  const float cscale = tf ? kLog2e : scale * kLog2e;
  b.qf.resize(group * d);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t x = 0; x < d; ++x) b.qf[g * d + x] = static_cast<float>(q[g * q_head + x]);
  grow(b.kw, KT * d);
  grow(b.kt, KT * d);
  if constexpr (NV == 0) grow(b.vw, KT * dp);
  b.s.resize(group * KT);
  b.ot.assign(group * dp, 0.f);
  b.m.assign(group, kNegInf);
  b.l.assign(group, 0.f);
  b.alpha.resize(group);
  b.sum.resize(2 * group);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t k0 = first_tile(pos, window); k0 <= pos; k0 += KT) {
    const Tile t(k0, lo, pos, W);
    if (t.empty()) continue;
    t.rows(table, block_size, d, b.off);
    for (int64_t j = t.c0; j < t.c1; ++j) {  // key rows widened; zeros where not seen
      float* kr = b.kw.data() + j * d;
      const int64_t p = k0 + j;
      if (p < t.a || p >= t.e) {
        std::fill(kr, kr + d, 0.f);
        continue;
      }
      const T* src = kh + b.off[j];
      for (int64_t x = 0; x < d; ++x) kr[x] = static_cast<float>(src[x]);
      if constexpr (NV == 0) {
        const T* vs = vh + b.off[j];
        for (int64_t x = 0; x < d; ++x) b.vw[j * dp + x] = static_cast<float>(vs[x]);
      }
    }
    for (int64_t c = t.c0; c < t.c1; c += W) rows_to_lanes(b.kw.data() + c * d, d, W, d, b.kt.data() + c * d);
    const Ahead ahead = ahead_of(kh, vh, table, k0, pos, block_size, d);
    by_heads<kScoreHeads>(group, [&](auto nh, int64_t g0) {
      f32_scores<decltype(nh)::value>(b.qf.data(), b.kt.data(), d, g0, b.s.data(), g0 == 0 ? ahead : Ahead());
    });
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = t.c0; c < t.c1; c += W) {
        float* sc = b.s.data() + g * KT + c;
        transform(Vec::loadu(sc), tf, scale, softcap, k0 + c, t.a, t.e).store(sc);
      }
    softmax_tile(b.s.data(), group, t, cscale, b.m.data(), b.l.data(), b.alpha.data(), b.sum.data());
    if constexpr (NV > 0) {
      by_heads<(NV >= 16 ? 1 : std::min(4, 16 / NV))>(group, [&](auto nh, int64_t g0) {
        f32_values<T, NV, decltype(nh)::value>(vh, b.off, t, b.s.data(), b.alpha.data(), g0, b.ot.data());
      });
    } else {
      for (int64_t g = 0; g < group; ++g) {
        float* og = b.ot.data() + g * dp;
        const float* sg = b.s.data() + g * KT;
        for (int64_t x = 0; x < dp; x += W) (Vec::loadu(og + x) * Vec(b.alpha[g])).store(og + x);
        for (int64_t j = t.a; j < t.e; ++j) {
          const Vec pv(sg[j - k0]);
          const float* vr = b.vw.data() + (j - k0) * dp;
          for (int64_t x = 0; x < dp; x += W)
            at::vec::fmadd(pv, Vec::loadu(vr + x), Vec::loadu(og + x)).store(og + x);
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) store_out<T>(b.ot.data() + g * dp, b.l[g], d, out + g * d);
}

#if defined(CPU_CAPABILITY_AVX512)
// ---- bfloat16 with AVX512-BF16 dot products: prefill_attention_bf16.cpp's bf16_dot_task for one lane ----
// Products pair dimensions (scores) and keys (values, the probabilities rounded to bfloat16).

// Scores of heads [g0, g0 + NH) against the tile's keys (pairs transposed: ktp [KT/16][dh][16]).
template <int NH>
TAPLLM_TARGET_AVX512BF16
void bf16_scores(const uint32_t* qp, const uint32_t* ktp, int64_t dh, int64_t g0, float* s) {
  __m512 acc[NH][KT / 16];
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < KT / 16; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t x = 0; x < dh; ++x) {
    __m512bh kv[KT / 16];
    for (int64_t c = 0; c < KT / 16; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(ktp + (c * dh + x) * 16);
    for (int h = 0; h < NH; ++h) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(g0 + h) * dh + x]));
      for (int64_t c = 0; c < KT / 16; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], qv, kv[c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int64_t c = 0; c < KT / 16; ++c) _mm512_storeu_ps(s + (g0 + h) * KT + c * 16, acc[h][c]);
}

// bf16_row: each 16 keys' rows are requested into L1 while the 16 before them are transposed, value
// rows kValuesAhead pairs before their use.
constexpr int64_t kValuesAhead = 4;
constexpr int64_t kTilesPerPass = 8;  // bf16_row: 512 keys' rows (64 KB of keys and values at head size 64) stay in L2

// Outputs of heads [g0, g0 + NH) (NV vectors of 16 dims each) over the key pairs [jp0, jp1) of the tile at
// k0: each pair's value rows interleaved in registers as bf16_dot_task's value tile holds them (word 2i
// from the first key, word 2i + 1 from the second; a key not seen is zeros, its probability 0).
template <int NV, int NH>
TAPLLM_TARGET_AVX512BF16
void bf16_values(const uint16_t* vh, const int64_t* off, const Tile& t, const uint16_t* pb, const float* alpha,
                 int64_t jp0, int64_t jp1, int64_t g0, float* ot) {
  constexpr int64_t D = NV * 16;
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  __m512 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v)
      acc[h][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + (g0 + h) * D + v * 16), _mm512_set1_ps(alpha[g0 + h]));
  for (int64_t jp = jp0; jp < jp1; ++jp) {
    const int64_t p0 = t.k0 + 2 * jp, p1 = p0 + 1;
    if (g0 == 0 && p1 + 2 * kValuesAhead < t.e) {
      const char* ahead0 = reinterpret_cast<const char*>(vh + off[2 * (jp + kValuesAhead)]);
      const char* ahead1 = reinterpret_cast<const char*>(vh + off[2 * (jp + kValuesAhead) + 1]);
      for (int64_t b = 0; b < D * 2; b += 64) {
        _mm_prefetch(ahead0 + b, _MM_HINT_T0);
        _mm_prefetch(ahead1 + b, _MM_HINT_T0);
      }
    }
    const uint16_t* r0 = p0 >= t.a && p0 < t.e ? vh + off[2 * jp] : nullptr;
    const uint16_t* r1 = p1 >= t.a && p1 < t.e ? vh + off[2 * jp + 1] : nullptr;
    __m512bh vv[NV];
    for (int v = 0; v < NV; v += 2) {
      const __m512i va = r0 != nullptr ? _mm512_loadu_si512(r0 + v * 16) : _mm512_setzero_si512();
      const __m512i vc = r1 != nullptr ? _mm512_loadu_si512(r1 + v * 16) : _mm512_setzero_si512();
      vv[v] = (__m512bh)_mm512_permutex2var_epi16(va, lo_idx, vc);
      vv[v + 1] = (__m512bh)_mm512_permutex2var_epi16(va, hi_idx, vc);
    }
    for (int h = 0; h < NH; ++h) {
      uint32_t bits;
      std::memcpy(&bits, pb + (g0 + h) * KT + 2 * jp, 4);
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_dpbf16_ps(acc[h][v], pv, vv[v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ot + (g0 + h) * D + v * 16, acc[h][v]);
}

template <int MAXH>
TAPLLM_TARGET_AVX512BF16
void bf16_scores_all(const uint32_t* qp, const uint32_t* ktp, int64_t dh, int64_t group, float* s) {
  for (int64_t g0 = 0; g0 < group; g0 += MAXH) {
    switch (std::min<int64_t>(MAXH, group - g0)) {
      case 1: bf16_scores<1>(qp, ktp, dh, g0, s); break;
      case 2: bf16_scores<2>(qp, ktp, dh, g0, s); break;
      case 3: bf16_scores<3>(qp, ktp, dh, g0, s); break;
      default: bf16_scores<4>(qp, ktp, dh, g0, s); break;
    }
  }
}

template <int NV>
TAPLLM_TARGET_AVX512BF16
void bf16_values_all(const uint16_t* vh, const int64_t* off, const Tile& t, const uint16_t* pb, const float* alpha,
                     int64_t jp0, int64_t jp1, int64_t group, float* ot) {
  constexpr int MAXH = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);
  for (int64_t g0 = 0; g0 < group; g0 += MAXH) {
    const int64_t nh = std::min<int64_t>(MAXH, group - g0);
    if (nh == 1) {
      bf16_values<NV, 1>(vh, off, t, pb, alpha, jp0, jp1, g0, ot);
    } else if constexpr (MAXH >= 2) {
      if (nh == 2) {
        bf16_values<NV, 2>(vh, off, t, pb, alpha, jp0, jp1, g0, ot);
      } else if constexpr (MAXH >= 4) {
        if (nh == 3) {
          bf16_values<NV, 3>(vh, off, t, pb, alpha, jp0, jp1, g0, ot);
        } else {
          bf16_values<NV, 4>(vh, off, t, pb, alpha, jp0, jp1, g0, ot);
        }
      }
    }
  }
}

// NV: vectors of 16 dims per head (head size 16 NV, a multiple of 32), 0: any such head size.
// The tiles run in groups of kTilesPerPass: first the scores of every tile of the group (the scores do
// not depend on the softmax's state), streaming the keys and requesting the values into L2 as
// decode_attention does, then each tile's softmax and values in order. Each tile's arithmetic is the
// one-tile-at-a-time sequence the prefill kernel's lane runs; only when the loads happen changes.
template <int NV>
TAPLLM_TARGET_AVX512BF16
void bf16_row(const uint16_t* q, int64_t q_head, const uint16_t* kh, const uint16_t* vh, uint16_t* out,
              const int64_t* table, int64_t pos, int64_t group, int64_t d, int64_t block_size, float scale,
              int64_t window, float softcap, RowScratch& b) {
  const int64_t dh = d / 2;
  const bool tf = softcap > 0.f || !(scale > 0.f);
  const float cscale = tf ? kLog2e : scale * kLog2e;
  b.qp.resize(group * dh);
  for (int64_t g = 0; g < group; ++g) std::memcpy(b.qp.data() + g * dh, q + g * q_head, d * 2);
  grow(b.kp, KT * dh);
  grow(b.ktp, KT * dh);
  if constexpr (NV == 0) b.vt.resize(KT / 2 * d);
  b.pb.resize(group * KT);
  b.s.resize(kTilesPerPass * group * KT);
  b.offs.resize(kTilesPerPass * KT);
  b.ot.assign(group * d, 0.f);
  b.m.assign(group, kNegInf);
  b.l.assign(group, 0.f);
  b.alpha.resize(group);
  b.sum.resize(2 * group);
  // as bf16_dot_task pairs value rows: word 2i from the first key, word 2i + 1 from the second
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  for (int64_t g0 = first_tile(pos, window); g0 <= pos; g0 += kTilesPerPass * KT) {
    const int64_t tiles = std::min(kTilesPerPass, (pos - g0) / KT + 1);
    // ---- the scores of the group's tiles
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t k0 = g0 + i * KT;
      const Tile t(k0, lo, pos, 16);
      if (t.empty()) continue;
      int64_t* off = b.offs.data() + i * KT;
      t.rows(table, block_size, d, off);
      for (int64_t c = t.c0; c < t.c1; c += 16) {  // 16 keys a pass, moved as float32 bits (pairs)

        if (c + 16 < t.c1) {  // the next 16 key rows into L1
          for (int64_t j = std::max(c + 16, t.a - k0); j < std::min(c + 32, t.e - k0); ++j) {
            const char* row = reinterpret_cast<const char*>(kh + off[j]);
            for (int64_t x = 0; x < d * 2; x += 64) _mm_prefetch(row + x, _MM_HINT_T0);
          }
        }
        const float* src;
        if (k0 + c >= t.a && k0 + c + 16 <= t.e && off[c + 15] == off[c] + 15 * d) {
          src = reinterpret_cast<const float*>(kh + off[c]);  // 16 visible keys in a row of the cache: read in place
        } else {
          for (int64_t j = c; j < c + 16; ++j) {
            const int64_t p = k0 + j;
            if (p < t.a || p >= t.e) {
              std::memset(b.kp.data() + j * dh, 0, d * 2);
            } else {
              std::memcpy(b.kp.data() + j * dh, kh + off[j], d * 2);
            }
          }
          src = reinterpret_cast<const float*>(b.kp.data() + c * dh);
        }
        rows_to_lanes(src, dh, 16, dh, reinterpret_cast<float*>(b.ktp.data() + c * dh));
      }
      bf16_scores_all<4>(b.qp.data(), b.ktp.data(), dh, group, b.s.data() + i * group * KT);
    }
    // ---- each tile's softmax and values, in order
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t k0 = g0 + i * KT;
      const Tile t(k0, lo, pos, 16);
      if (t.empty()) continue;
      const int64_t* off = b.offs.data() + i * KT;
      float* s = b.s.data() + i * group * KT;
      const int64_t jp0 = (t.a - k0) / 2, jp1 = (t.e - k0 + 1) / 2;  // the key pairs holding the visible keys
      for (int64_t jp = jp0; NV == 0 && jp < jp1; ++jp) {  // NV > 0: pairs made in registers (bf16_values)
        const uint16_t* vr[2];
        for (int u = 0; u < 2; ++u) {
          const int64_t p = k0 + 2 * jp + u;
          vr[u] = p >= t.a && p < t.e ? vh + off[2 * jp + u] : nullptr;
        }
        uint32_t* vp = b.vt.data() + jp * d;
        for (int64_t x = 0; x < d; x += 32) {
          const __m512i va = vr[0] ? _mm512_loadu_si512(vr[0] + x) : _mm512_setzero_si512();
          const __m512i vc = vr[1] ? _mm512_loadu_si512(vr[1] + x) : _mm512_setzero_si512();
          _mm512_storeu_si512(vp + x, _mm512_permutex2var_epi16(va, lo_idx, vc));
          _mm512_storeu_si512(vp + x + 16, _mm512_permutex2var_epi16(va, hi_idx, vc));
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = t.c0; c < t.c1; c += 16) {
          float* sc = s + g * KT + c;
          transform(Vec(_mm512_loadu_ps(sc)), tf, scale, softcap, k0 + c, t.a, t.e).store(sc);
        }
      softmax_tile(s, group, t, cscale, b.m.data(), b.l.data(), b.alpha.data(), b.sum.data());
      for (int64_t g = 0; g < group; ++g)  // the probabilities in bfloat16 (0 where not seen: exp2(-inf))
        for (int64_t c = t.c0; c < t.c1; c += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.pb.data() + g * KT + c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + g * KT + c)));
      if constexpr (NV > 0) {
        bf16_values_all<NV>(vh, off, t, b.pb.data(), b.alpha.data(), jp0, jp1, group, b.ot.data());
      } else {
        for (int64_t g = 0; g < group; ++g) {
          float* og = b.ot.data() + g * d;
          for (int64_t x = 0; x < d; x += 16)
            _mm512_storeu_ps(og + x, _mm512_mul_ps(_mm512_loadu_ps(og + x), _mm512_set1_ps(b.alpha[g])));
          for (int64_t jp = jp0; jp < jp1; ++jp) {
            uint32_t bits;
            std::memcpy(&bits, b.pb.data() + g * KT + 2 * jp, 4);
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
            const uint32_t* vp = b.vt.data() + jp * d;
            for (int64_t x = 0; x < d; x += 16)
              _mm512_storeu_ps(og + x,
                               _mm512_dpbf16_ps(_mm512_loadu_ps(og + x), pv, (__m512bh)_mm512_loadu_si512(vp + x)));
          }
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    store_out<at::BFloat16>(b.ot.data() + g * d, b.l[g], d, reinterpret_cast<at::BFloat16*>(out) + g * d);
}
#endif

template <typename T>
void rows(const T* q, const T* kc, const T* vc, T* out, const int64_t* tables, const int64_t* lens, int64_t batch,
          int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t head_slots, int64_t table_width,
          int64_t q_row, int64_t q_head, float scale, int64_t window, float softcap) {
  const int64_t group = heads / kv_heads;
  auto each = [&](auto task_fn) {
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      RowScratch scratch;
      auto first_tile_of = [&](int64_t task) {
        const int64_t bi = task / kv_heads, hk = task % kv_heads;
        prefetch_first(kc + hk * head_slots * d, vc + hk * head_slots * d, tables + bi * table_width, lens[bi] - 1,
                       window, block_size, d);
      };
      for (int64_t task = begin; task < end; ++task) {
        if (task == begin) first_tile_of(task);
        if (task + 1 < end) first_tile_of(task + 1);  // the next task's first tile, during this one
        const int64_t bi = task / kv_heads, hk = task % kv_heads;
        task_fn(q + bi * q_row + hk * group * q_head, kc + hk * head_slots * d, vc + hk * head_slots * d,
                out + (bi * heads + hk * group) * d, tables + bi * table_width, lens[bi] - 1, scratch);
      }
    });
  };
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {  // the prefill kernel's own choice (prefill_rows)
    if (d % 32 == 0 && q_row % 2 == 0 && q_head % 2 == 0 && bf16_dot_supported()) {
      auto dot = [&](auto nv_tag) {
        each([&](const T* qb, const T* kh, const T* vh, T* ob, const int64_t* table, int64_t pos, RowScratch& s) {
          bf16_row<decltype(nv_tag)::value>(
              reinterpret_cast<const uint16_t*>(qb), q_head, reinterpret_cast<const uint16_t*>(kh),
              reinterpret_cast<const uint16_t*>(vh), reinterpret_cast<uint16_t*>(ob), table, pos, group, d,
              block_size, scale, window, softcap, s);
        });
      };
      switch (d) {
        case 64: dot(std::integral_constant<int, 4>()); break;
        case 128: dot(std::integral_constant<int, 8>()); break;
        case 256: dot(std::integral_constant<int, 16>()); break;
        default: dot(std::integral_constant<int, 0>()); break;
      }
      return;
    }
  }
#endif
  auto f32 = [&](auto nv_tag) {
    each([&](const T* qb, const T* kh, const T* vh, T* ob, const int64_t* table, int64_t pos, RowScratch& s) {
      f32_row<T, decltype(nv_tag)::value>(qb, q_head, kh, vh, ob, table, pos, group, d, block_size, scale, window,
                                          softcap, s);
    });
  };
  switch (d % W == 0 ? d / W : 0) {
    case 1: f32(std::integral_constant<int, 1>()); break;
    case 2: f32(std::integral_constant<int, 2>()); break;
    case 4: f32(std::integral_constant<int, 4>()); break;
    case 5: f32(std::integral_constant<int, 5>()); break;
    case 6: f32(std::integral_constant<int, 6>()); break;
    case 8: f32(std::integral_constant<int, 8>()); break;
    case 16: f32(std::integral_constant<int, 16>()); break;
    default: f32(std::integral_constant<int, 0>()); break;
  }
}

}  // namespace
}  // namespace prefill

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
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
    TORCH_CHECK(ln[b] >= 1 && (ln[b] + bs - 1) / bs <= block_tables.size(1), "sequence ", b,
                "'s block table is too short");
    for (int64_t j = 0; j < (ln[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tb[b * block_tables.size(1) + j] >= 0 && tb[b * block_tables.size(1) + j] < blocks, "sequence ", b,
                  " names block ", tb[b * block_tables.size(1) + j], " of a cache of ", blocks);
  }
  auto out = at::empty({q.size(0), q.size(1), d}, q.options());
  const int64_t head_slots = blocks * bs;
  TAPLLM_DISPATCH(q.scalar_type(), "row_attention", [&] {
    prefill::rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), tb, ln, q.size(0), q.size(1), kv_heads, d, bs, head_slots,
                            block_tables.size(1), q.stride(0), q.stride(1), scale, window, softcap);
  });
  return out;
}

}  // namespace tapllm
