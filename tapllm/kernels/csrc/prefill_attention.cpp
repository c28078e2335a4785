// Causal attention of prefill chunks over the paged KV cache, read in place.
//
// A chunk's queries sit at positions [context, context + n) of its sequence; its keys and
// values (the cached context and the chunk itself, already written by kv_write) are read from
// the sequence's blocks. One task is (chunk, KV head, block of query positions): its G query
// heads share every key tile. Key tiles are widened to float32 (K transposed) once per task;
// scores and the weighted sums are register-tiled FMAs over 4 query rows at a time, with an
// online (flash-style) softmax, all in float32; the output is rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

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
constexpr int64_t KT = 4 * 16;  // keys per tile (a multiple of every vector width)
constexpr int64_t QB = 64;      // query positions per task (its key tiles are widened once for all of them)
constexpr int RB = 4;           // query rows (position x head) computed together

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// O[i] += sum_j p[i][j] V[j] for RB rows with DV vectors per row held in registers.
template <int DV>
inline void accumulate_values(const float* p, const float* vt, float* o, int64_t nk, int64_t dp) {
  Vec ov[RB][DV];
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < DV; ++v) ov[i][v] = Vec::loadu(o + i * dp + v * W);
  for (int64_t j = 0; j < nk; ++j) {
    Vec vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = Vec::loadu(vt + j * dp + v * W);
    for (int i = 0; i < RB; ++i) {
      const Vec pij(p[i * KT + j]);
      for (int v = 0; v < DV; ++v) ov[i][v] = at::vec::fmadd(pij, vv[v], ov[i][v]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int v = 0; v < DV; ++v) ov[i][v].store(o + i * dp + v * W);
}

struct Task {
  int64_t chunk, head, first;  // KV head; first query position (relative to the chunk)
};

#if defined(CPU_CAPABILITY_AVX512)
#define TAPLLM_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// A bfloat16 task with AVX512-BF16 dot products (vdpbf16ps: 32 products summed pairwise into 16
// float32 lanes per instruction, twice the FMA rate). Q.K sums pairs of dimensions: the key tile
// is stored as [d/2][KT] pairs, a query row's pair broadcast. P.V sums pairs of keys: the value
// tile is [KT/2][d] pairs of rows and the probabilities are rounded to bfloat16 pairs first, as
// PyTorch's own bf16 attention does. Scores, softmax and the accumulators stay float32.
// DV: vectors of 16 per head row (d = 16 * DV).
template <int DV>
TAPLLM_BF16_TARGET void bf16_dot_task(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out,
                                      const int64_t* table, int64_t qstart, int64_t first, int64_t n, int64_t ctx,
                                      int64_t group, int64_t hk, int64_t heads, int64_t block_size, int64_t q_row,
                                      int64_t q_head, float scale, int64_t window, float softcap, uint32_t* qp,
                                      uint32_t* ktp, uint32_t* vtp, uint32_t* pp, float* o, float* m, float* l,
                                      float* s) {
  constexpr int64_t d = 16 * DV, dh = d / 2;
  constexpr int NV = KT / 16;
  const int64_t rows = n * group;
  const int64_t padded = (rows + RB - 1) / RB * RB;
  for (int64_t r = 0; r < padded; ++r) {
    uint32_t* dst = qp + r * dh;
    if (r < rows) {
      std::memcpy(dst, q + (qstart + first + r / group) * q_row + (hk * group + r % group) * q_head, d * 2);
    } else {
      std::memset(dst, 0, d * 2);
    }
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::memset(o, 0, padded * d * sizeof(float));
  const int64_t last_pos = ctx + first + n - 1;
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctx + first - window + 1) : 0;
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
    const int64_t nk = std::min(KT, last_pos + 1 - k0);
    for (int64_t j = 0; j < KT; j += 2) {  // the tile's pairs; keys past nk are zero
      const uint32_t* kr[2];
      const uint16_t* vr[2];
      for (int u = 0; u < 2; ++u) {
        const int64_t p = k0 + std::min(j + u, nk - 1);
        const int64_t slot = table[p / block_size] * block_size + p % block_size;
        kr[u] = reinterpret_cast<const uint32_t*>(kh + slot * d);
        vr[u] = vh + slot * d;
      }
      const bool real0 = j < nk, real1 = j + 1 < nk;
      for (int64_t e = 0; e < dh; ++e) {
        ktp[e * KT + j] = real0 ? kr[0][e] : 0u;
        ktp[e * KT + j + 1] = real1 ? kr[1][e] : 0u;
      }
      uint32_t* vp = vtp + (j / 2) * d;
      for (int64_t e = 0; e < d; ++e)
        vp[e] = (real0 ? uint32_t(vr[0][e]) : 0u) | ((real1 ? uint32_t(vr[1][e]) : 0u) << 16);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int rb = static_cast<int>(std::min<int64_t>(RB, rows - r0));
      __m512 acc[RB][NV];
      for (int i = 0; i < RB; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
      for (int64_t e = 0; e < dh; ++e) {
        __m512bh kv[NV];
        for (int v = 0; v < NV; ++v) kv[v] = (__m512bh)_mm512_loadu_si512(ktp + e * KT + v * 16);
        for (int i = 0; i < RB; ++i) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(r0 + i) * dh + e]));
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], qv, kv[v]);
        }
      }
      // stored with compile-time indices at once: indexing acc by the row loop below would keep
      // the accumulators in memory (spilled on every step of the dot loop)
      for (int i = 0; i < RB; ++i)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + i * KT + v * 16, acc[i][v]);
      for (int i = 0; i < RB; ++i) {
        const int64_t r = r0 + i;
        const int64_t pos = ctx + first + r / group;
        float* sr = s + i * KT;
        uint32_t* pr = pp + i * (KT / 2);
        const int64_t lo = i < rb ? std::max<int64_t>(0, (window > 0 ? pos - window + 1 : 0) - k0) : 0;
        const int64_t hi = i < rb ? std::min<int64_t>(nk, pos + 1 - k0) : 0;
        if (hi <= lo) {  // padding row, or no visible key in this tile
          std::memset(pr, 0, KT * 2);
          continue;
        }
        for (int v = 0; v < NV; ++v) {
          Vec x = Vec::loadu(sr + v * 16) * Vec(scale);
          if (softcap > 0.f) x = (x * Vec(1.f / softcap)).tanh() * Vec(softcap);
          x.store(sr + v * 16);
        }
        for (int64_t j = 0; j < lo; ++j) sr[j] = -std::numeric_limits<float>::infinity();
        for (int64_t j = hi; j < KT; ++j) sr[j] = -std::numeric_limits<float>::infinity();
        Vec vmx(-std::numeric_limits<float>::infinity());
        for (int v = 0; v < NV; ++v) vmx = at::vec::maximum(vmx, Vec::loadu(sr + v * 16));
        const float mx = std::max(m[r], at::vec::vec_reduce_all<float>(
            [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmx));
        const float rescale = std::exp(m[r] - mx);
        Vec vsum(0.f);
        for (int v = 0; v < NV; v += 2) {
          const Vec e0 = (Vec::loadu(sr + v * 16) - Vec(mx)).exp();
          const Vec e1 = (Vec::loadu(sr + (v + 1) * 16) - Vec(mx)).exp();
          vsum = vsum + e0 + e1;
          _mm512_storeu_si512(pr + v * 8, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        l[r] = l[r] * rescale + at::vec::vec_reduce_all<float>(std::plus<Vec>(), vsum);
        m[r] = mx;
        if (rescale != 1.f) {
          float* orow = o + r * d;
          for (int v = 0; v < DV; ++v) (Vec::loadu(orow + v * 16) * Vec(rescale)).store(orow + v * 16);
        }
      }
      const int64_t pairs = (nk + 1) / 2;
      for (int v0 = 0; v0 < DV; v0 += 4) {  // four output vectors of the RB rows in registers at a time
        __m512 ov[RB][4];
        for (int i = 0; i < RB; ++i)
          for (int v = 0; v < 4; ++v) ov[i][v] = _mm512_loadu_ps(o + (r0 + i) * d + (v0 + v) * 16);
        for (int64_t jp = 0; jp < pairs; ++jp) {
          __m512bh vv[4];
          for (int v = 0; v < 4; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vtp + jp * d + (v0 + v) * 16);
          for (int i = 0; i < RB; ++i) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * (KT / 2) + jp]));
            for (int v = 0; v < 4; ++v) ov[i][v] = _mm512_dpbf16_ps(ov[i][v], pv, vv[v]);
          }
        }
        for (int i = 0; i < RB; ++i)
          for (int v = 0; v < 4; ++v) _mm512_storeu_ps(o + (r0 + i) * d + (v0 + v) * 16, ov[i][v]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    auto* dst = reinterpret_cast<at::BFloat16*>(out) + ((qstart + first + r / group) * heads + hk * group + r % group) * d;
    const Vec inv(1.f / l[r]);
    for (int v = 0; v < DV; ++v) at::vec::convert_from_float<at::BFloat16>(Vec::loadu(o + r * d + v * 16) * inv,
                                                                         Vec(0.f)).store(dst + v * 16, 16);
  }
}

// Whether the CPU runs vdpbf16ps. CPUID is the right test here: AVX512-BF16 works on the
// zmm state that the OS has already enabled for AVX512 (ATen's AVX512 dispatch checks it);
// unlike AMX tiles, no further permission is asked of the kernel.
bool bf16_dot_supported() {
  static const bool ok = [] {
    const char* env = std::getenv("TAPLLM_BF16_DOT");  // "0": float32 products (for comparisons)
    return __builtin_cpu_supports("avx512bf16") && !(env != nullptr && std::string(env) == "0");
  }();
  return ok;
}
#endif

template <typename T>
void prefill_rows(const T* q, const T* kc, const T* vc, T* out, const int64_t* starts, const int64_t* lens,
                  const int64_t* contexts, const int64_t* tables, int64_t table_width, int64_t heads,
                  int64_t kv_heads, int64_t d, int64_t block_size, int64_t head_slots, int64_t q_row, int64_t q_head,
                  float scale, int64_t window, float softcap, const std::vector<Task>& tasks) {
  const int64_t group = heads / kv_heads;
  const int64_t dv = (d + W - 1) / W;  // vectors per head row (the tail is zero-padded)
  const int64_t dp = dv * W;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if ((d == 64 || d == 128) && bf16_dot_supported()) {
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<uint32_t> qp(QB * group * d / 2 + RB * d), ktp(d / 2 * KT), vtp(KT / 2 * d), pp(RB * KT / 2);
        std::vector<float> o((QB * group + RB) * d), m(QB * group + RB), l(QB * group + RB), s(RB * KT);
        for (int64_t ti = begin; ti < end; ++ti) {
          const Task& task = tasks[ti];
          const int64_t c = task.chunk;
          const auto* q16 = reinterpret_cast<const uint16_t*>(q);
          const auto* k16 = reinterpret_cast<const uint16_t*>(kc) + task.head * head_slots * d;
          const auto* v16 = reinterpret_cast<const uint16_t*>(vc) + task.head * head_slots * d;
          auto* o16 = reinterpret_cast<uint16_t*>(out);
          const int64_t n = std::min(QB, lens[c] - task.first);
          auto run = [&](auto dv_tag) {
            bf16_dot_task<decltype(dv_tag)::value>(q16, k16, v16, o16, tables + c * table_width, starts[c], task.first,
                                                   n, contexts[c], group, task.head, heads, block_size, q_row, q_head,
                                                   scale, window, softcap, qp.data(), ktp.data(), vtp.data(), pp.data(),
                                                   o.data(), m.data(), l.data(), s.data());
          };
          if (d == 64) run(std::integral_constant<int, 4>()); else run(std::integral_constant<int, 8>());
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(dp * KT), vt(KT * dp), qf, o, m, l, s(RB * KT);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = tasks[ti];
      const int64_t c = task.chunk, hk = task.head;
      const int64_t n = std::min(QB, lens[c] - task.first);
      const int64_t rows = n * group;  // row r: position first + r / group, head hk * group + r % group
      const int64_t padded = (rows + RB - 1) / RB * RB;  // whole groups of RB rows; the padding stays zero
      const int64_t ctx = contexts[c];
      const int64_t* table = tables + c * table_width;
      qf.assign(padded * dp, 0.f);
      o.assign(padded * dp, 0.f);
      m.assign(padded, -std::numeric_limits<float>::infinity());
      l.assign(padded, 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        const T* src = q + (starts[c] + task.first + r / group) * q_row + (hk * group + r % group) * q_head;
        for (int64_t j = 0; j < d; ++j) qf[r * dp + j] = to_float(src[j]) * scale;
      }
      const int64_t last_pos = ctx + task.first + n - 1;  // no key past the last query is needed
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, ctx + task.first - window + 1) : 0;
      const T* kh = kc + hk * head_slots * d;
      const T* vh = vc + hk * head_slots * d;
      for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
        const int64_t nk = std::min(KT, last_pos + 1 - k0);
        for (int64_t j = 0; j < KT; ++j) {  // widen the tile: K transposed [dp][KT], V [KT][dp]
          float* vrow = vt.data() + j * dp;
          if (j < nk) {
            const int64_t p = k0 + j;
            const int64_t slot = table[p / block_size] * block_size + p % block_size;
            const T* kr = kh + slot * d;
            const T* vr = vh + slot * d;
            for (int64_t e = 0; e < d; ++e) kt[e * KT + j] = to_float(kr[e]);
            int64_t e = 0;
            for (; e + W <= d; e += W) loadf<T>(vr + e).store(vrow + e);
            for (; e < d; ++e) vrow[e] = to_float(vr[e]);
            for (e = d; e < dp; ++e) kt[e * KT + j] = vrow[e] = 0.f;
          } else {
            for (int64_t e = 0; e < dp; ++e) kt[e * KT + j] = vrow[e] = 0.f;
          }
        }
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
          const int rb = static_cast<int>(std::min<int64_t>(RB, rows - r0));  // real rows of the group
          constexpr int NV = KT / W;
          Vec acc[RB][NV];
          for (int i = 0; i < RB; ++i)
            for (int v = 0; v < NV; ++v) acc[i][v] = Vec(0.f);
          for (int64_t e = 0; e < d; ++e) {
            Vec kv[NV];
            for (int v = 0; v < NV; ++v) kv[v] = Vec::loadu(kt.data() + e * KT + v * W);
            for (int i = 0; i < RB; ++i) {  // a compile-time count keeps acc in registers
              const Vec qv(qf[(r0 + i) * dp + e]);
              for (int v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(qv, kv[v], acc[i][v]);
            }
          }
          for (int i = 0; i < RB; ++i)  // compile-time indices (see bf16_dot_task)
            for (int v = 0; v < NV; ++v) acc[i][v].store(s.data() + i * KT + v * W);
          for (int i = 0; i < RB; ++i) {
            const int64_t r = r0 + i;
            const int64_t pos = ctx + task.first + r / group;
            float* sr = s.data() + i * KT;
            if (i >= rb) {  // padding row
              std::fill(sr, sr + KT, 0.f);
              continue;
            }
            // keys [lo, hi) of this tile are visible to the row; the rest get probability 0
            const int64_t lo = std::max<int64_t>(0, (window > 0 ? pos - window + 1 : 0) - k0);
            const int64_t hi = std::min<int64_t>(nk, pos + 1 - k0);
            if (hi <= lo) {
              std::fill(sr, sr + KT, 0.f);
              continue;
            }
            Vec vmx(-std::numeric_limits<float>::infinity());
            for (int v = 0; v < NV; ++v) {
              Vec x = Vec::loadu(sr + v * W);
              if (softcap > 0.f) x = (x * Vec(1.f / softcap)).tanh() * Vec(softcap);
              x.store(sr + v * W);
            }
            for (int64_t j = 0; j < lo; ++j) sr[j] = -std::numeric_limits<float>::infinity();
            for (int64_t j = hi; j < KT; ++j) sr[j] = -std::numeric_limits<float>::infinity();
            for (int v = 0; v < NV; ++v) vmx = at::vec::maximum(vmx, Vec::loadu(sr + v * W));
            const float mx = std::max(m[r], at::vec::vec_reduce_all<float>(
                [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmx));
            const float rescale = std::exp(m[r] - mx);
            Vec vsum(0.f);
            for (int v = 0; v < NV; ++v) {
              const Vec e = (Vec::loadu(sr + v * W) - Vec(mx)).exp();
              e.store(sr + v * W);
              vsum = vsum + e;
            }
            l[r] = l[r] * rescale + at::vec::vec_reduce_all<float>(std::plus<Vec>(), vsum);
            m[r] = mx;
            float* orow = o.data() + r * dp;
            if (rescale != 1.f)
              for (int64_t v = 0; v < dv; ++v) (Vec::loadu(orow + v * W) * Vec(rescale)).store(orow + v * W);
          }
          if (dv == 4) {
            accumulate_values<4>(s.data(), vt.data(), o.data() + r0 * dp, nk, dp);
          } else if (dv == 8) {
            accumulate_values<8>(s.data(), vt.data(), o.data() + r0 * dp, nk, dp);
          } else {
            for (int64_t v = 0; v < dv; ++v) {  // O[r] += sum_j p[r][j] V[j], V loads shared by the rows
              Vec ov[RB];
              for (int i = 0; i < RB; ++i) ov[i] = Vec::loadu(o.data() + (r0 + i) * dp + v * W);
              for (int64_t j = 0; j < nk; ++j) {
                const Vec vv = Vec::loadu(vt.data() + j * dp + v * W);
                for (int i = 0; i < RB; ++i) ov[i] = at::vec::fmadd(Vec(s[i * KT + j]), vv, ov[i]);
              }
              for (int i = 0; i < RB; ++i) ov[i].store(o.data() + (r0 + i) * dp + v * W);
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = out + ((starts[c] + task.first + r / group) * heads + hk * group + r % group) * d;
        const float inv = 1.f / l[r];
        for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(o[r * dp + j] * inv);
      }
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
    // Heavy (late) and light (early) query blocks alternate, so threads taking halves of the list balance.
    const int64_t nb = (ln[c] + QB - 1) / QB;
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t b = i % 2 == 0 ? nb - 1 - i / 2 : i / 2;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({c, h, b * QB});
    }
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
