// Causal attention of prefill chunks over the paged KV cache (prefill_attention): the float32 task,
// which every dtype can take, and the op. The design is described in prefill_attention.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "checks.h"
#include "kernels.h"
#include "prefill_attention.h"
#include "vec_math.h"

namespace tapllm {
namespace prefill {
namespace {

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
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
  const int64_t first_key = first_tile(rows.ctx + rows.first, window);
  TileRows tr;
  for (int64_t k0 = first_key; k0 <= last_pos; k0 += KT) {
    const int64_t nk = std::min(KT, last_pos + 1 - k0);
    for (int64_t j = 0; j < KT; ++j) {
      float* krow = b.kt.data() + j * d;
      float* vrow = b.vt.data() + j * dp;
      if (j < nk) {
        const int64_t p = k0 + j;
        const int64_t slot = paged_slot(table, p, block_size);
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

template <typename T>
void prefill_rows(const T* q, const T* kc, const T* vc, T* out, const int64_t* starts, const int64_t* lens,
                  const int64_t* contexts, const int64_t* tables, int64_t table_width, int64_t heads,
                  int64_t kv_heads, int64_t d, int64_t block_size, int64_t head_slots, int64_t q_row, int64_t q_head,
                  float scale, int64_t window, float softcap, bool tiles, const std::vector<Task>& tasks) {
  const int64_t group = heads / kv_heads;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (d % 32 == 0 && q_row % 2 == 0 && q_head % 2 == 0 && bf16_dot_supported()) {
      const bool amx = tiles && amx_supported();
      at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
        Scratch b;
        std::vector<uint32_t> qt, kt, vt;
        if (amx) amx_begin();
        for (int64_t ti = begin; ti < end; ++ti) {
          const Task& task = tasks[ti];
          const int64_t c = task.chunk;
          const Rows rows{contexts[c], task.first, std::min(QB, lens[c] - task.first), group};
          (amx ? amx_task : bf16_dot_task)(reinterpret_cast<const uint16_t*>(q),
                        reinterpret_cast<const uint16_t*>(kc) + task.head * head_slots * d,
                        reinterpret_cast<const uint16_t*>(vc) + task.head * head_slots * d,
                        reinterpret_cast<uint16_t*>(out), tables + c * table_width, starts[c], rows, heads, task.head,
                        d, block_size, q_row, q_head, scale, window, softcap, b, qt, kt, vt);
        }
        if (amx) amx_end();
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
}  // namespace prefill

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& contexts,
                             const at::Tensor& block_tables, double scale, int64_t window, double softcap,
                             bool tiles) {
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
  std::vector<prefill::Task> tasks;
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(st[c] >= 0 && ln[c] >= 1 && st[c] + ln[c] <= q.size(0) && cx[c] >= 0, "chunk ", c, " out of range");
    TORCH_CHECK((cx[c] + ln[c] + bs - 1) / bs <= block_tables.size(1), "chunk ", c, "'s block table is too short");
    // Heavy (late) and light (early) query blocks alternate, so threads taking halves of the list balance;
    // a head's blocks follow each other, so its keys and values stay in cache from one to the next.
    const int64_t nb = (ln[c] + prefill::QB - 1) / prefill::QB;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t i = 0; i < nb; ++i) tasks.push_back({c, h, (i % 2 == 0 ? nb - 1 - i / 2 : i / 2) * prefill::QB});
  }
  auto out = at::zeros({q.size(0), q.size(1), d}, q.options());
  const int64_t head_slots = k_cache.size(1) * bs;
  TAPLLM_DISPATCH(q.scalar_type(), "prefill_attention", [&] {
    prefill::prefill_rows<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                     out.data_ptr<scalar_t>(), st, ln, cx, block_tables.data_ptr<int64_t>(),
                                     block_tables.size(1), q.size(1), kv_heads, d, bs, head_slots, q.stride(0),
                                     q.stride(1), scale, window, softcap, tiles, tasks);
  });
  return out;
}

}  // namespace tapllm
