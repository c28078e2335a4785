// Weight-only quantized linears: y = x W^T + b with W kept in GGUF-style blocks, dequantized
// in registers (never into memory) for decode-sized row counts, and one column chunk at a
// time into a GEMM for prefill sizes.
//
// A weight is one uint8 tensor [N, G, B]: for each output row, G blocks of g = K / G inputs,
// each block B bytes (tapllm/quant/pack.py writes them; GGUF files hold the same blocks):
//   B == 2 + g     int8:  float16 d, g int8 q;              w = d * q      (GGUF Q8_0 when g = 32)
//   B == 4 + g/2   int4:  float16 d, float16 m, g/2 bytes;  w = d * q + m  (GGUF Q4_1 when g = 32)
//   B == 18, g=32  Q4_0:  float16 d, 16 bytes;              w = d * (q - 8)
//   B == 144, g=256 Q4_K, B == 210, g=256 Q6_K: GGUF's K-quant super-blocks (see quant_layout.h)
// In 4-bit blocks each run of 32 weights takes 16 bytes: byte j holds weight j (low nibble) and
// weight j + 16 (high nibble), GGUF's order.
//
// Arithmetic: per block, the integer-weighted sum of x in float32, times d, plus m times the
// block's sum of x. It differs from x @ dequant(W)^T in float32 only by the order of the sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "quant_layout.h"

namespace tapllm {
using namespace quant;
namespace {

#define TAPLLM_QUANT_DISPATCH(TYPE, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, "quant", __VA_ARGS__)

// More rows than this: dequantize a column chunk, then GEMM (measured against bf16 oneDNN linears
// on the default model's shapes: the in-register kernel stops paying beyond these row counts).
constexpr int64_t kMaxFusedRows = 4;
constexpr int64_t kChunkBytes = 16 << 20;  // dequantized weight held at once on the GEMM path

// d and m of a block (m = -8 d for Q4_0, 0 for int8)
inline void block_scale(const Layout& l, const uint8_t* blk, float& d, float& m) {
  d = half_at(blk);
  m = l.kind == kInt4 ? half_at(blk + 2) : (l.kind == kQ40 ? -8.f * d : 0.f);
}

inline int64_t header(Kind kind) { return kind == kInt4 ? 4 : 2; }

// ---- a few vector helpers, one width per instruction set ----------------------------------
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kW = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline void storeu(float* p, V a) { _mm512_storeu_ps(p, a); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V u8_to_f(__m128i b, int) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline V i8_to_f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V s8_to_f(__m128i b, int) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kW = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline void storeu(float* p, V a) { _mm256_storeu_ps(p, a); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V u8_to_f(__m128i b, int part) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part ? _mm_srli_si128(b, 8) : b));
}
inline V i8_to_f(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V s8_to_f(__m128i b, int part) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part ? _mm_srli_si128(b, 8) : b));
}
#endif

// Rows of x widened to float32 [m, K], and each row's sums over runs of sum_run(l) inputs.
struct Rows {
  const float* x;
  const float* xs;
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Rows [r0, r0 + MR) x columns [n, n + NC) into out[r * ldo + col]; KIND fixed at compile time so
// the block loop has no branches, GS > 0 a block size known at compile time (unrolled inner loop).
template <int MR, int NC, int KIND, int GS>
inline void tile(const Layout& l, const Rows& rows, int64_t r0, const uint8_t* w, int64_t n, float* out,
                 int64_t ldo) {
  constexpr bool kFour = KIND != kInt8;
  constexpr int64_t kHdr = KIND == kInt4 ? 4 : 2;
  const int64_t k = l.k, g = GS > 0 ? GS : l.group, groups = l.groups, bytes = l.bytes;
  const __m128i low = _mm_set1_epi8(0x0F);
  V acc[MR][NC];
  float mterm[MR][NC] = {};
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
  const TileCols<NC> cols(l, w, n);
  for (int64_t b = 0; b < groups; ++b) {
    cols.ahead.touch(b);
    V t0[MR][NC], t1[MR][NC];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NC; ++c) t0[r][c] = t1[r][c] = vzero();
    const int64_t kb = b * g;
    for (int c = 0; c < NC; ++c) {
      const uint8_t* q = cols.col[c] + b * bytes + kHdr;
      for (int64_t s = 0; s < g; s += 32) {
        if constexpr (kFour) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + s / 2));
          const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
          for (int part = 0; part < 16 / kW; ++part) {
            const V wl = u8_to_f(lo, part), wh = u8_to_f(hi, part);
            for (int r = 0; r < MR; ++r) {
              const float* xr = rows.x + (r0 + r) * k + kb + s + part * kW;
              t0[r][c] = vfma(wl, vload(xr), t0[r][c]);
              t1[r][c] = vfma(wh, vload(xr + 16), t1[r][c]);
            }
          }
        } else {
          for (int part = 0; part < 16 / kW; ++part) {
            const V wa = i8_to_f(q + s + part * kW), wb = i8_to_f(q + s + 16 + part * kW);
            for (int r = 0; r < MR; ++r) {
              const float* xr = rows.x + (r0 + r) * k + kb + s + part * kW;
              t0[r][c] = vfma(wa, vload(xr), t0[r][c]);
              t1[r][c] = vfma(wb, vload(xr + 16), t1[r][c]);
            }
          }
        }
      }
    }
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = cols.col[c] + b * bytes;
      const float d = half_at(blk);
      const V dv = vset(d);
      for (int r = 0; r < MR; ++r) acc[r][c] = vfma(dv, vadd(t0[r][c], t1[r][c]), acc[r][c]);
      if constexpr (kFour) {
        const float m = KIND == kInt4 ? half_at(blk + 2) : -8.f * d;
        for (int r = 0; r < MR; ++r) mterm[r][c] += m * rows.xs[(r0 + r) * groups + b];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[(r0 + r) * ldo + n + c] = vsum(acc[r][c]) + mterm[r][c];
}

// The K-quant kinds: per run of 32 inputs, its two halves' products summed apart (Q6_K's scales
// change every 16 inputs), then scaled into the column's sum.
template <int MR, int KIND, int P>
inline void k_pair(const uint8_t* blk, const KScales& ks, const Rows& rows, int64_t r0, const float* xb,
                   int64_t k, int64_t run0, V (&acc)[MR], float (&mterm)[MR]) {
  __m256i q[2];
  k_pair_bytes<KIND, P>(blk, q[0], q[1]);
  for (int h = 0; h < 2; ++h) {
    const int t = 2 * P + h;
    const __m128i lo = _mm256_castsi256_si128(q[h]), hi = _mm256_extracti128_si256(q[h], 1);
    V t0[MR], t1[MR];
    for (int r = 0; r < MR; ++r) t0[r] = t1[r] = vzero();
    for (int part = 0; part < 16 / kW; ++part) {
      const V wl = KIND == kQ4K ? u8_to_f(lo, part) : s8_to_f(lo, part);
      const V wh = KIND == kQ4K ? u8_to_f(hi, part) : s8_to_f(hi, part);
      for (int r = 0; r < MR; ++r) {
        const float* xr = xb + r * k + t * 32 + part * kW;
        t0[r] = vfma(wl, vload(xr), t0[r]);
        t1[r] = vfma(wh, vload(xr + 16), t1[r]);
      }
    }
    if constexpr (KIND == kQ4K) {
      for (int r = 0; r < MR; ++r) {
        acc[r] = vfma(vset(ks.d[t]), vadd(t0[r], t1[r]), acc[r]);
        mterm[r] += ks.m[t] * rows.xs[(r0 + r) * (k / 32) + run0 + t];
      }
    } else {
      for (int r = 0; r < MR; ++r) acc[r] = vfma(vset(ks.d[2 * t + 1]), t1[r], vfma(vset(ks.d[2 * t]), t0[r], acc[r]));
    }
  }
}

template <int MR, int NC, int KIND>
inline void tile_k(const Layout& l, const Rows& rows, int64_t r0, const uint8_t* w, int64_t n, float* out) {
  const int64_t k = l.k, groups = l.groups, bytes = l.bytes;
  V acc[NC][MR];
  float mterm[NC][MR] = {};
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < MR; ++r) acc[c][r] = vzero();
  const TileCols<NC> cols(l, w, n);
  for (int64_t b = 0; b < groups; ++b) {
    cols.ahead.touch(b);
    const float* xb = rows.x + r0 * k + b * kSuper;
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = cols.col[c] + b * bytes;
      KScales ks;
      k_scales(static_cast<Kind>(KIND), blk, ks);
      k_pair<MR, KIND, 0>(blk, ks, rows, r0, xb, k, b * 8, acc[c], mterm[c]);
      k_pair<MR, KIND, 1>(blk, ks, rows, r0, xb, k, b * 8, acc[c], mterm[c]);
      k_pair<MR, KIND, 2>(blk, ks, rows, r0, xb, k, b * 8, acc[c], mterm[c]);
      k_pair<MR, KIND, 3>(blk, ks, rows, r0, xb, k, b * 8, acc[c], mterm[c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC; ++c) out[(r0 + r) * l.n + n + c] = vsum(acc[c][r]) + mterm[c][r];
}

template <int MR, int NC, int KIND>
inline void tile_of(const Layout& l, const Rows& rows, int64_t r0, const uint8_t* w, int64_t n, float* out) {
  if constexpr (KIND == kQ4K || KIND == kQ6K) {
    tile_k<MR, NC, KIND>(l, rows, r0, w, n, out);
  } else {
    switch (l.group) {
      case 32: return tile<MR, NC, KIND, 32>(l, rows, r0, w, n, out, l.n);
      case 64: return tile<MR, NC, KIND, 64>(l, rows, r0, w, n, out, l.n);
      case 128: return tile<MR, NC, KIND, 128>(l, rows, r0, w, n, out, l.n);
      default: return tile<MR, NC, KIND, 0>(l, rows, r0, w, n, out, l.n);
    }
  }
}
#endif

// One row x one column, scalar (the generic build, and columns left over after the tiles).
inline float dot_scalar(const Layout& l, const Rows& rows, int64_t r, const uint8_t* w, int64_t n) {
  const float* x = rows.x + r * l.k;
  float total = 0.f;
  if (is_k(l.kind)) {
    for (int64_t b = 0; b < l.groups; ++b) {
      const uint8_t* blk = w + (n * l.groups + b) * l.bytes;
      KScales ks;
      k_scales(l.kind, blk, ks);
      for (int t = 0; t < 8; ++t) {
        int8_t q[32];
        k_run(l.kind, blk, t, q);
        const float* xb = x + b * kSuper + t * 32;
        float t0 = 0.f, t1 = 0.f;
        for (int i = 0; i < 16; ++i) {
          t0 += static_cast<float>(q[i]) * xb[i];
          t1 += static_cast<float>(q[16 + i]) * xb[16 + i];
        }
        total += k_scale(l.kind, ks, t, 0) * t0 + k_scale(l.kind, ks, t, 1) * t1 +
                 ks.m[t] * rows.xs[r * (l.k / 32) + b * 8 + t];
      }
    }
    return total;
  }
  for (int64_t b = 0; b < l.groups; ++b) {
    const uint8_t* blk = w + (n * l.groups + b) * l.bytes;
    const uint8_t* q = blk + header(l.kind);
    const float* xb = x + b * l.group;
    float d, m, t = 0.f;
    block_scale(l, blk, d, m);
    if (l.kind == kInt8) {
      for (int64_t i = 0; i < l.group; ++i) t += static_cast<float>(static_cast<int8_t>(q[i])) * xb[i];
    } else {
      for (int64_t s = 0; s < l.group; s += 32)
        for (int j = 0; j < 16; ++j) t += (q[s / 2 + j] & 15) * xb[s + j] + (q[s / 2 + j] >> 4) * xb[s + 16 + j];
    }
    total += d * t + (l.kind == kInt8 ? 0.f : m * rows.xs[r * l.groups + b]);
  }
  return total;
}

// out [m, N] (float32) for m <= kMaxFusedRows; one parallel region per call.
void fused_rows(const Layout& l, const Rows& rows, int64_t m, const uint8_t* w, float* out) {
  for_tiles(
      l, m,
      [&](auto mr, auto nc, auto kind, int64_t r0, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
        tile_of<decltype(mr)::value, decltype(nc)::value, decltype(kind)::value>(l, rows, r0, w, n, out);
#endif
      },
      [&](int64_t r, int64_t n) { out[r * l.n + n] = dot_scalar(l, rows, r, w, n); });
}

// Dequantize one block into float32 ob[0, g).
inline void dequant_block(const Layout& l, const uint8_t* blk, float* ob) {
  if (is_k(l.kind)) {
    KScales ks;
    k_scales(l.kind, blk, ks);
    for (int t = 0; t < 8; ++t) {
      int8_t q[32];
      k_run(l.kind, blk, t, q);
      for (int i = 0; i < 32; ++i) ob[t * 32 + i] = k_scale(l.kind, ks, t, i / 16) * static_cast<float>(q[i]) + ks.m[t];
    }
    return;
  }
  const uint8_t* q = blk + header(l.kind);
  float d, m;
  block_scale(l, blk, d, m);
  int64_t s = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const V dv = vset(d), mv = vset(m);
  if (l.kind == kInt8) {
    for (; s < l.group; s += kW) storeu(ob + s, vmul(dv, i8_to_f(q + s)));
  } else {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (; s < l.group; s += 32) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + s / 2));
      const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
      for (int part = 0; part < 16 / kW; ++part) {
        storeu(ob + s + part * kW, vfma(dv, u8_to_f(lo, part), mv));
        storeu(ob + s + 16 + part * kW, vfma(dv, u8_to_f(hi, part), mv));
      }
    }
  }
#endif
  for (; s < l.group; s += 32) {  // the generic build
    for (int j = 0; j < 32; ++j) {
      if (l.kind == kInt8) {
        ob[s + j] = d * static_cast<float>(static_cast<int8_t>(q[s + j]));
      } else {
        const uint8_t byte = q[s / 2 + (j & 15)];
        ob[s + j] = d * static_cast<float>(j < 16 ? byte & 15 : byte >> 4) + m;
      }
    }
  }
}

// Dequantize rows [n0, n1) of W into out [n1 - n0, K] of T (via one float32 row per thread).
template <typename T>
void dequant_rows(const Layout& l, const uint8_t* w, int64_t n0, int64_t n1, T* out) {
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t e) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : l.k);
    for (int64_t n = a; n < e; ++n) {
      float* o = std::is_same_v<T, float> ? reinterpret_cast<float*>(out + (n - n0) * l.k) : row.data();
      for (int64_t b = 0; b < l.groups; ++b) dequant_block(l, w + (n * l.groups + b) * l.bytes, o + b * l.group);
      if constexpr (!std::is_same_v<T, float>) at::vec::convert(row.data(), out + (n - n0) * l.k, l.k);
    }
  });
}

}  // namespace

at::Tensor quant_dequantize(const at::Tensor& w, int64_t k, at::ScalarType dtype) {
  const Layout l = layout_of(w, k);
  auto out = at::empty({l.n, k}, at::TensorOptions().dtype(dtype));
  TAPLLM_QUANT_DISPATCH(dtype, [&] { dequant_rows<scalar_t>(l, w.data_ptr<uint8_t>(), 0, l.n, out.data_ptr<scalar_t>()); });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t act_bits) {
  TORCH_CHECK(act_bits == 0 || act_bits == 8, "quant_linear: act_bits must be 0 (float) or 8, got ", act_bits);
  TORCH_CHECK(x.dim() >= 1, "quant_linear: x must have a feature dimension");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "quant_linear: x must be float32, bfloat16 or float16");
  if (act_bits == 8) return quant_linear_a8(x, w, bias);
  const int64_t k = x.size(-1);
  const Layout l = layout_of(w, k);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = l.n;
  const int64_t m = k > 0 ? x.numel() / k : 0;
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor y;
  if (m <= kMaxFusedRows) {
    at::Tensor xf = x.reshape({m, k}).to(at::kFloat).contiguous();
    const int64_t run = sum_run(l);
    at::Tensor xs = xf.view({m, k / run, run}).sum(-1).contiguous();
    at::Tensor out = at::empty({m, l.n}, xf.options());
    fused_rows(l, Rows{xf.data_ptr<float>(), xs.data_ptr<float>()}, m, w.data_ptr<uint8_t>(), out.data_ptr<float>());
    if (has_bias) out.add_(bias->to(at::kFloat));
    y = out.to(x.scalar_type());
  } else {  // prefill sizes: the GEMM library's throughput wins; only a chunk of W is ever dequantized
    at::Tensor x2 = x.reshape({m, k});
    y = at::empty({m, l.n}, x.options());
    const int64_t kChunkCols = std::max<int64_t>(256, kChunkBytes / (k * x.element_size()));
    at::Tensor chunk = at::empty({std::min(l.n, kChunkCols), k}, x.options());
    for (int64_t n0 = 0; n0 < l.n; n0 += kChunkCols) {
      const int64_t n1 = std::min(l.n, n0 + kChunkCols);
      TAPLLM_QUANT_DISPATCH(x.scalar_type(), [&] {
        dequant_rows<scalar_t>(l, w.data_ptr<uint8_t>(), n0, n1, chunk.data_ptr<scalar_t>());
      });
      std::optional<at::Tensor> b;
      if (has_bias) b = bias->narrow(0, n0, n1 - n0).to(x.scalar_type());
      y.narrow(1, n0, n1 - n0).copy_(at::linear(x2, chunk.narrow(0, 0, n1 - n0), b));
    }
  }
  return y.view(shape);
}

}  // namespace tapllm
