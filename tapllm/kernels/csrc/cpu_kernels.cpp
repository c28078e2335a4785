// tapllm's fused CPU kernels: one source, compiled once per instruction set (AVX512, AVX2)
// with ATen's at::vec, registered as torch.library ops in the namespace TAPLLM_NS.
//
// Every kernel reproduces the rounding steps of the eager PyTorch code it replaces (values
// are rounded to the tensor dtype where the eager code produces a tensor of that dtype), so
// the compiled step and the eager step differ only in the order of floating-point sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "kernels.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

// float32, bfloat16 and float16, with the element type as scalar_t in the body.
#define TAPLLM_DISPATCH(TYPE, NAME, ...)                                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace tapllm {

constexpr int64_t W = Vec::size();

// bfloat16 <-> float32 in registers. at::vec narrows two vectors at once (32 lanes packed and
// permuted) and stores them masked; one vector at a time, with the same integer round to nearest
// even and the same NaN (0xffff), costs a third of that.
#if defined(CPU_CAPABILITY_AVX512)
inline __m512i bf16_round_bits(__m512 v) {  // float32 bits + rounding bias (the bf16 is the high half)
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
}
inline __m256i bf16_narrow(__m512 v) {
  const __m512i t = _mm512_srli_epi32(bf16_round_bits(v), 16);
  const __m512i nan = _mm512_set1_epi32(0xffff);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(t, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan));
}
inline __m512 bf16_round(__m512 v) {
  const __m512i t = _mm512_and_si512(bf16_round_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m512i nan = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(t, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan));
}
inline bool bf16_hw() {
  static const bool has = __builtin_cpu_supports("avx512bf16") && !std::getenv("TAPLLM_NO_AVX512BF16");
  return has;
}
#elif defined(CPU_CAPABILITY_AVX2)
inline __m256i bf16_round_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
}
inline __m128i bf16_narrow(__m256 v) {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // all ones: 0xffff after the shift
  const __m256i t = _mm256_srli_epi32(_mm256_or_si256(bf16_round_bits(v), nan), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}
inline __m256 bf16_round(__m256 v) {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i t = _mm256_and_si256(bf16_round_bits(v), _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_castsi256_ps(_mm256_or_si256(t, nan));  // NaN: 0xffff0000 (all ones, then masked)
}
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kFastBF16 = true;
#else
constexpr bool kFastBF16 = false;
#endif
#if !defined(CPU_CAPABILITY_AVX512)
inline bool bf16_hw() { return false; }
#endif

// Runs f(std::true_type) when T is bfloat16 and the CPU converts it in hardware, else f(std::false_type):
// the HW template argument of the element-wise kernels.
template <typename T, typename F>
inline void with_bf16_hw(bool allowed, F&& f) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (allowed && bf16_hw()) return f(std::true_type());
  }
#endif
  f(std::false_type());
}

template <typename T>
inline void storef(T* p, const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && kFastBF16) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_narrow(v));
#elif defined(CPU_CAPABILITY_AVX2)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_narrow(v));
#endif
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, W);
  }
}

// The value a float takes once stored in T and read back (identity for float).
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && kFastBF16) {
#if defined(CPU_CAPABILITY_AVX512)
    return bf16_round(v);
#elif defined(CPU_CAPABILITY_AVX2)
    return bf16_round(v);
#endif
  } else {  // in registers: narrow (round to nearest even, as a store to T does) and widen back
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// Stores v in T at p and returns the stored value widened (round_to<T>(v)).
template <typename T>
inline Vec store_rounded(T* p, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i b = bf16_narrow(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
#endif
  const Vec r = round_to<T>(v);
  storef<T>(p, r);
  return r;
}

// float32 -> T for the element-wise kernels. With HW (bfloat16 on a CPU with AVX512-BF16): one
// vcvtneps2bf16 per vector, which rounds to nearest even as the integer path does but flushes
// denormals and keeps NaN payloads where the integer path (and at::vec, hence the eager step)
// gives denormals and 0xffff. Such lanes are only noted (a branch per vector cost a quarter of
// the kernel's time) and the caller redoes the row without HW, so the bits never differ.
template <typename T, bool HW>
struct Narrow {
  Vec round(const Vec& v) { return round_to<T>(v); }
  void store(T* p, const Vec& v) { storef<T>(p, v); }
  bool ok() const { return true; }
};
#if defined(CPU_CAPABILITY_AVX512)
template <>
struct Narrow<c10::BFloat16, true> {
  __mmask16 bad = 0;
  __m256i bits(__m512 v) {
    bad = _kor_mask16(bad, _mm512_fpclass_ps_mask(v, 0xA1));  // QNaN | SNaN | denormal
    __m256i r;
    asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(v));  // inline asm: this build's flags lack avx512bf16
    return r;
  }
  Vec round(const Vec& v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits(v)), 16)); }
  void store(c10::BFloat16* p, const Vec& v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits(v)); }
  bool ok() const { return bad == 0; }
};
#endif

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// ---- RMSNorm: w * round(x * rsqrt(mean(x^2) + eps)), optionally after x += r -------------
// Row i's output from its (updated) x and 1 / rms; false when Narrow asks for the row again.
template <typename T, int MODE, bool HW>
bool rms_scale(const T* xi, const T* w, T* oi, int64_t n, float inv) {
  Narrow<T, HW> cv;
  const Vec vinv(inv), one(1.f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec h = loadf<T>(xi + j) * vinv;
    if constexpr (MODE == 0) cv.store(oi + j, loadf<T>(w + j) * cv.round(h));  // Llama: round, then scale in T
    if constexpr (MODE == 1) cv.store(oi + j, loadf<T>(w + j) * h);  // scale in float32, round once (OLMo-2)
    if constexpr (MODE == 2) cv.store(oi + j, (loadf<T>(w + j) + one) * h);  // Gemma: (1 + w) in float32
  }
  for (; j < n; ++j) {
    const float h = static_cast<float>(xi[j]) * inv, wj = static_cast<float>(w[j]);
    oi[j] = static_cast<T>(MODE == 0 ? wj * round_to<T>(h) : MODE == 1 ? wj * h : (1.f + wj) * h);
  }
  return cv.ok();
}

// R rows at a time, each summing its squares in the order of one row alone: R independent
// chains of FMAs where one row's chain (its latency, not the loads) bounds the first pass.
template <typename T, int MODE, bool HW, int R>
void rms_rows(T* x, const T* r, const T* w, T* out, int64_t n, int64_t x_stride, int64_t r_stride,
              int64_t out_stride, float eps) {
  Vec acc[R];
  float tail[R];
  for (int k = 0; k < R; ++k) acc[k] = Vec(0.f), tail[k] = 0.f;
  int64_t j = 0;
  if (r != nullptr) {  // residual add, rounded to T as the eager add is, and the squares in the same pass
    for (; j + W <= n; j += W)
      for (int k = 0; k < R; ++k) {
        T* xk = x + k * x_stride + j;
        const Vec v = store_rounded<T>(xk, loadf<T>(xk) + loadf<T>(r + k * r_stride + j));
        acc[k] = at::vec::fmadd(v, v, acc[k]);
      }
    for (; j < n; ++j)
      for (int k = 0; k < R; ++k) {
        T& xk = x[k * x_stride + j];
        xk = static_cast<T>(static_cast<float>(xk) + static_cast<float>(r[k * r_stride + j]));
        tail[k] += static_cast<float>(xk) * static_cast<float>(xk);
      }
  } else {
    for (; j + W <= n; j += W)
      for (int k = 0; k < R; ++k) {
        const Vec v = loadf<T>(x + k * x_stride + j);
        acc[k] = at::vec::fmadd(v, v, acc[k]);
      }
    for (; j < n; ++j)
      for (int k = 0; k < R; ++k) tail[k] += static_cast<float>(x[k * x_stride + j]) * static_cast<float>(x[k * x_stride + j]);
  }
  for (int k = 0; k < R; ++k) {
    const float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[k]) + tail[k];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    const T* xk = x + k * x_stride;
    T* ok = out + k * out_stride;
    if (!rms_scale<T, MODE, HW>(xk, w, ok, n, inv)) rms_scale<T, MODE, false>(xk, w, ok, n, inv);
  }
}

template <typename T>
void rms_norm_rows(T* x, const T* r, const T* w, T* out, int64_t rows, int64_t n, int64_t x_stride,
                   int64_t r_stride, int64_t out_stride, float eps, int64_t mode) {
  constexpr int R = 4;
  auto run = [&](auto mode_tag) {
    constexpr int MODE = decltype(mode_tag)::value;
    with_bf16_hw<T>(true, [&](auto hw) {
      constexpr bool HW = decltype(hw)::value;
      at::parallel_for(0, (rows + R - 1) / R, 4, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin * R; i < std::min(rows, end * R);) {
          const T* ri = r == nullptr ? nullptr : r + i * r_stride;
          if (i + R <= rows) {
            rms_rows<T, MODE, HW, R>(x + i * x_stride, ri, w, out + i * out_stride, n, x_stride, r_stride, out_stride, eps);
            i += R;
          } else {
            rms_rows<T, MODE, HW, 1>(x + i * x_stride, ri, w, out + i * out_stride, n, x_stride, r_stride, out_stride, eps);
            i += 1;
          }
        }
      });
    });
  };
  if (mode == 0) run(std::integral_constant<int, 0>());
  else if (mode == 1) run(std::integral_constant<int, 1>());
  else run(std::integral_constant<int, 2>());
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t mode) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(), "bad weight");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  TAPLLM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), 0, out.stride(0), eps, mode);
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& r, const at::Tensor& w, double eps, int64_t mode) {
  check_rows(x, "x");
  check_rows(r, "residual");
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type(), "residual must match x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(), "bad weight");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  TAPLLM_DISPATCH(x.scalar_type(), "add_rms_norm_", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0), r.stride(0), out.stride(0),
                            eps, mode);
  });
  return out;
}

// ---- gated activation: round(round(act(gate)) * up) over [T, 2I] -> [T, I] -----------------
// exp(x), inline: at::vec's exp is a call into Sleef (u10), whose spills and range checks cost
// more than the whole SiLU. Cody-Waite reduction by ln2 (Cephes' split and polynomial, within
// about 1 ulp), then scalef, which gives inf/0 past the float range; x is clamped so that
// +-inf give inf/0 and NaN stays NaN.
inline Vec exp_inline(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = _mm512_min_ps(_mm512_set1_ps(150.f), _mm512_max_ps(_mm512_set1_ps(-150.f), v));  // NaN: x
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
#else
  return v.exp();
#endif
}

template <typename T, int MODE, bool HW>
bool gated_row(const T* g, const T* u, T* o, int64_t inter) {
  Narrow<T, HW> cv;
  const Vec one(1.f), half(0.5f), c0(0.7978845608028654f), c1(0.044715f);
  int64_t j = 0;
  if constexpr (MODE == 0) {  // SiLU, four vectors in step: one at a time leaves the core waiting on exp/div latency
    constexpr int U = 4;
    for (; j + U * W <= inter; j += U * W) {
      Vec x[U], e[U], a[U];
      for (int k = 0; k < U; ++k) x[k] = loadf<T>(g + j + k * W);
      for (int k = 0; k < U; ++k) e[k] = exp_inline(x[k].neg());
      for (int k = 0; k < U; ++k) a[k] = x[k] / (one + e[k]);
      for (int k = 0; k < U; ++k) a[k] = cv.round(a[k]) * loadf<T>(u + j + k * W);
      for (int k = 0; k < U; ++k) cv.store(o + j + k * W, a[k]);
    }
  }
  for (; j + W <= inter; j += W) {
    const Vec x = loadf<T>(g + j);
    Vec a;
    if constexpr (MODE == 0) a = x / (one + exp_inline(x.neg()));  // SiLU
    else a = half * x * (one + (c0 * (x + c1 * x * x * x)).tanh());  // GELU, tanh approximation
    cv.store(o + j, cv.round(a) * loadf<T>(u + j));
  }
  for (; j < inter; ++j) {
    const float x = static_cast<float>(g[j]);
    const float a = MODE == 0 ? x / (1.f + std::exp(-x))
                              : 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    o[j] = static_cast<T>(round_to<T>(a) * static_cast<float>(u[j]));
  }
  return cv.ok();
}

template <typename T>
void gated_rows(const T* gu, T* out, int64_t rows, int64_t inter, int64_t in_stride, int64_t mode) {
  auto run = [&](auto mode_tag) {
    constexpr int MODE = decltype(mode_tag)::value;
    with_bf16_hw<T>(true, [&](auto hw) {
      at::parallel_for(0, rows, 1, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const T* g = gu + i * in_stride;
          if (!gated_row<T, MODE, decltype(hw)::value>(g, g + inter, out + i * inter, inter))
            gated_row<T, MODE, false>(g, g + inter, out + i * inter, inter);
        }
      });
    });
  };
  if (mode == 0) run(std::integral_constant<int, 0>());
  else run(std::integral_constant<int, 1>());
}

at::Tensor gated_act(const at::Tensor& gu, int64_t mode) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t inter = gu.size(1) / 2;
  auto out = at::empty({gu.size(0), inter}, gu.options());
  TAPLLM_DISPATCH(gu.scalar_type(), "gated_act", [&] {
    gated_rows<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gu.size(0), inter, gu.stride(0), mode);
  });
  return out;
}

// ---- rotary (rotate-half layout) on the first R dims of every head, in place --------------
// cos/sin are rows [T, R] (one per token). In T (what the eager code casts them to) each
// product and the sum are rounded to T, as there; in float32 (OLMo-2) the rotation is
// computed in float32 and rounded once.
// One head: x's first rdim = 2 * half dims rotated into out (x itself, or a buffer for Narrow's sake).
template <typename T, typename C, bool HW>
inline bool rotary_head(const T* x, T* out, const C* c, const C* s, int64_t half) {
  constexpr bool steps = std::is_same_v<T, C>;
  Narrow<T, HW> cv;
  auto r = [&](const Vec& v) { return steps ? cv.round(v) : v; };
  auto rs = [](float v) { return steps ? round_to<T>(v) : v; };
  int64_t j = 0;
  for (; j + W <= half; j += W) {
    const Vec a = loadf<T>(x + j), b = loadf<T>(x + j + half);
    const Vec lo = r(a * loadf<C>(c + j)) + r(b.neg() * loadf<C>(s + j));
    const Vec hi = r(b * loadf<C>(c + j + half)) + r(a * loadf<C>(s + j + half));
    cv.store(out + j, lo);
    cv.store(out + j + half, hi);
  }
  for (; j < half; ++j) {
    const float a = static_cast<float>(x[j]), b = static_cast<float>(x[j + half]);
    const float lo = rs(a * static_cast<float>(c[j])) + rs(-b * static_cast<float>(s[j]));
    const float hi = rs(b * static_cast<float>(c[j + half])) + rs(a * static_cast<float>(s[j + half]));
    out[j] = static_cast<T>(lo);
    out[j + half] = static_cast<T>(hi);
  }
  return cv.ok();
}

constexpr int64_t kRotaryBuffer = 512;  // the widest rotation that takes the HW path

// Row by row, the query heads then the key heads of the row (its cos/sin stay in L1).
template <typename T, typename C, bool HW>
void rotary_rows(T* q, T* k, int64_t rows, int64_t q_heads, int64_t k_heads, int64_t q_row, int64_t q_head,
                 int64_t k_row, int64_t k_head, const C* cos, const C* sin, int64_t cs_stride, int64_t rdim) {
  const int64_t half = rdim / 2;
  at::parallel_for(0, rows, 8, [=](int64_t begin, int64_t end) {
    T buf[HW ? kRotaryBuffer : 1];
    auto head = [&](T* v, const C* c, const C* s) {
      if constexpr (HW) {  // in place only once the head is known to need no second pass
        if (rotary_head<T, C, true>(v, buf, c, s, half)) std::memcpy(v, buf, rdim * sizeof(T));
        else rotary_head<T, C, false>(v, v, c, s, half);
      } else {
        rotary_head<T, C, false>(v, v, c, s, half);
      }
    };
    for (int64_t i = begin; i < end; ++i) {
      const C* c = cos + i * cs_stride;
      const C* s = sin + i * cs_stride;
      for (int64_t h = 0; h < q_heads; ++h) head(q + i * q_row + h * q_head, c, s);
      for (int64_t h = 0; h < k_heads; ++h) head(k + i * k_row + h * k_head, c, s);
    }
  });
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [T, heads, head_dim] with contiguous heads");
}

template <typename T, typename C>
void rotary_both(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int64_t rdim) {
  with_bf16_hw<T>(rdim <= kRotaryBuffer, [&](auto hw) {
    rotary_rows<T, C, decltype(hw)::value>(q.data_ptr<T>(), k.data_ptr<T>(), q.size(0), q.size(1), k.size(1),
                                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.data_ptr<C>(),
                                           sin.data_ptr<C>(), cos.stride(0), rdim);
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK(cos.dim() == 2 && cos.stride(1) == 1 && sin.sizes() == cos.sizes() && sin.strides() == cos.strides() &&
                  cos.size(0) == q.size(0) && k.size(0) == q.size(0), "cos/sin must be [T, R] rows");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && k.scalar_type() == q.scalar_type() &&
                  (cos.scalar_type() == q.scalar_type() || cos.scalar_type() == at::kFloat), "dtype mismatch");
  const int64_t rdim = cos.size(1);
  TORCH_CHECK(rdim % 2 == 0 && rdim <= q.size(2) && rdim <= k.size(2), "bad rotary width");
  const bool fcos = cos.scalar_type() == at::kFloat;
  TAPLLM_DISPATCH(q.scalar_type(), "rotary_", [&] {
    if (fcos) rotary_both<scalar_t, float>(q, k, cos, sin, rdim);
    else rotary_both<scalar_t, scalar_t>(q, k, cos, sin, rdim);
  });
}

// ---- KV cache write: cache [Hkv, blocks, block_size, D] at flat slots; V made finite ------
// Copied as integers (the compiler vectorises both loops); a value is non-finite when its exponent
// bits are all ones.
template <typename T>
void write_rows(const T* k, const T* v, T* kc, T* vc, const int64_t* slots, int64_t rows, int64_t heads,
                int64_t d, int64_t k_row, int64_t k_head, int64_t v_row, int64_t v_head, int64_t head_slots) {
  using U = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
  constexpr U expo = std::is_same_v<T, float> ? 0x7f800000u : std::is_same_v<T, c10::Half> ? 0x7c00 : 0x7f80;
  static_assert(sizeof(T) == sizeof(U));
  at::parallel_for(0, rows, 16, [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      for (int64_t h = 0; h < heads; ++h) {
        const U* ks = reinterpret_cast<const U*>(k + i * k_row + h * k_head);
        const U* vs = reinterpret_cast<const U*>(v + i * v_row + h * v_head);
        U* kd = reinterpret_cast<U*>(kc + (h * head_slots + slot) * d);
        U* vd = reinterpret_cast<U*>(vc + (h * head_slots + slot) * d);
        for (int64_t j = 0; j < d; ++j) kd[j] = ks[j];
        for (int64_t j = 0; j < d; ++j) vd[j] = (vs[j] & expo) == expo ? U(0) : vs[j];  // never inf/NaN in the cache
      }
    }
  });
}

void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4 && c.is_contiguous(), name, " must be a contiguous [Hkv, blocks, block_size, D] cache");
}

void kv_write(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  check_heads(k, "k");
  check_heads(v, "v");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0), "bad slots");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type(), "dtype mismatch");
  const int64_t head_slots = k_cache.size(1) * k_cache.size(2);
  TAPLLM_DISPATCH(k.scalar_type(), "kv_write", [&] {
    write_rows<scalar_t>(k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                         v_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), k.size(0), k.size(1), k.size(2),
                         k.stride(0), k.stride(1), v.stride(0), v.stride(1), head_slots);
  });
}

bool bf16_dot_supported() {
#if defined(CPU_CAPABILITY_AVX512)
  // CPUID is the right test here: AVX512-BF16 works on the zmm state that the OS has already
  // enabled for AVX512 (ATen's AVX512 dispatch checks it); unlike AMX tiles, no further
  // permission is asked of the kernel.
  static const bool ok = [] {
    const char* env = std::getenv("TAPLLM_BF16_DOT");
    return __builtin_cpu_supports("avx512bf16") && !(env != nullptr && std::string(env) == "0") &&
           !std::getenv("TAPLLM_NO_AVX512BF16");  // that switch stands for a CPU without AVX512-BF16
  }();
  return ok;
#else
  return false;
#endif
}

// ---- decode attention: one query per sequence, K/V read in place from their blocks --------
// Each task is one (sequence, KV head): the G query heads that share the KV head read its key
// and value rows (from L1/L2 after the first head). Scores, softmax and the weighted sum are
// computed in float32. NV (vectors per head row) is a template constant for the common head
// sizes so a head's query and accumulator stay in registers; 0 means "at run time".
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

// Asks for the rows of keys [begin, end) ahead of use: a sequence's blocks lie anywhere in the
// cache, so the hardware prefetcher, which follows strides, does not find them (5 GB/s without).
template <typename T, int HINT = _MM_HINT_T0>
inline void prefetch_rows(const T* base, const int64_t* table, int64_t begin, int64_t end, int64_t block_size,
                          int64_t d) {
  for (int64_t p = begin; p < end; ++p) {
    const char* row = reinterpret_cast<const char*>(base + (table[p / block_size] * block_size + p % block_size) * d);
    for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(row + b, static_cast<_mm_hint>(HINT));
  }
}

// Keys of a 16-key chunk: the chunk kKeysAhead on into L2, the next chunk from L2 into L1. Before,
// one distance (48 keys) into L1: the requests in flight were bounded by L1's miss buffers, and
// on scattered blocks (every 16 keys a new 2-4 KB run) the step ran at ~11-12 GB/s. Two
// distances, measured on a 2-core EPYC, 30 layers, blocks in random order, old and new alternating
// in one process: bf16 b64 x 544 keys 67 -> 46 ms, b64 x 160 21 -> 17.5 ms; fp32 (with the values
// into L2 as well) b64 x 544 119 -> 89 ms.
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
      const T* krow = kh + (table[p / block_size] * block_size + p % block_size) * D;
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
      const T* vrow = vh + (table[p / block_size] * block_size + p % block_size) * D;
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
#define TAPLLM_DOT_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))

// bfloat16 K/V with AVX512-BF16 dot products, for head sizes of DP x 32. In the float32 task above
// widening every key and value row costs as much as the products (a bf16 step ran at 11-14 GB/s,
// compute-bound even in cache). Q.K: a key row's pairs of dimensions times the query's, 16 keys
// summed by sum16. P.V: pairs of keys: the two value rows interleaved (vpunpck{l,h}wd, so lanes
// hold dims in a fixed permuted order, undone at the end) times the two probabilities rounded to
// bfloat16, as PyTorch's bf16 attention rounds them. Scores, softmax and sums are float32.
template <int DP>
TAPLLM_DOT_TARGET void decode_scores_dot(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, const int64_t* table,
                                         int64_t first, int64_t len, int64_t group, int64_t block_size,
                                         int64_t q_head, float scale, float* scores) {
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
      rows[j] = kh + (table[p / block_size] * block_size + p % block_size) * D;
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
TAPLLM_DOT_TARGET void dot_values(const uint16_t* vh, uint16_t* out, const int64_t* table, int64_t first, int64_t len,
                                  int64_t block_size, const uint16_t* probs, int64_t np, int64_t g0) {
  constexpr int64_t D = DP * 32;
  __m512 lo[HPN][DP], hi[HPN][DP];
  for (int h = 0; h < HPN; ++h)
    for (int v = 0; v < DP; ++v) lo[h][v] = hi[h][v] = _mm512_setzero_ps();
  if (g0 == 0) prefetch_rows(vh, table, first, std::min<int64_t>(len, first + 48), block_size, D);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t p = first + 2 * i, p1 = std::min(p + 1, len - 1);
    if (g0 == 0 && i % 8 == 0) prefetch_rows(vh, table, p + 48, std::min<int64_t>(len, p + 64), block_size, D);
    const uint16_t* a = vh + (table[p / block_size] * block_size + p % block_size) * D;
    const uint16_t* b = vh + (table[p1 / block_size] * block_size + p1 % block_size) * D;
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
TAPLLM_DOT_TARGET void decode_task_dot(const uint16_t* q, const uint16_t* kh, const uint16_t* vh, uint16_t* out,
                                       const int64_t* table, int64_t first, int64_t len, int64_t group,
                                       int64_t block_size, int64_t q_head, float scale, float softcap, float* scores,
                                       uint16_t* probs) {
  constexpr int64_t D = DP * 32;
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
      const T* krow = kh + (table[p / block_size] * block_size + p % block_size) * d;
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
      const T* vrow = vh + (table[p / block_size] * block_size + p % block_size) * d;
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

// TORCH_LIBRARY pastes its namespace argument; the indirection expands TAPLLM_NS first.
#define TAPLLM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TAPLLM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TAPLLM_LIBRARY(TAPLLM_NS, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, int mode) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor w, float eps, int mode) -> Tensor");
  m.def("gated_act(Tensor gate_up, int mode) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("kv_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor lens, float scale, "
        "int window, float softcap) -> Tensor");
}

TAPLLM_LIBRARY_IMPL(TAPLLM_NS, CPU, m) {
  m.impl("rms_norm", &tapllm::rms_norm);
  m.impl("add_rms_norm_", &tapllm::add_rms_norm_);
  m.impl("gated_act", &tapllm::gated_act);
  m.impl("rotary_", &tapllm::rotary_);
  m.impl("kv_write", &tapllm::kv_write);
  m.impl("decode_attention", &tapllm::decode_attention);
}
