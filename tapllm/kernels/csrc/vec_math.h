// Vector math shared by tapllm's kernels: widening loads, bfloat16 rounding as PyTorch rounds,
// the one exp polynomial, paged-row prefetches and what this CPU runs (AVX512-BF16).
//
// Every kernel reproduces the rounding steps of the eager PyTorch code it replaces (values
// are rounded to the tensor dtype where the eager code produces a tensor of that dtype), so
// the compiled step and the eager step differ only in the order of floating-point sums.
// The same header is compiled once per instruction set; ATen's at::vec picks the width from
// CPU_CAPABILITY_AVX512 / CPU_CAPABILITY_AVX2 (none: the generic build).
#pragma once
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <tuple>

// Functions that multiply bfloat16 with AVX512-BF16 (vdpbf16ps, vcvtneps2bf16): this build's flags
// lack the extension, so only these functions are compiled for it, and only called after
// bf16_dot_supported() (or packed_gemv_supported()) said the CPU has it.
#if defined(CPU_CAPABILITY_AVX512)
#define TAPLLM_TARGET_AVX512BF16 __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif

namespace tapllm {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // float32 lanes per vector

// ---- what this CPU runs ----------------------------------------------------------------------
// bfloat16 conversions in hardware (vcvtneps2bf16) for the element-wise kernels.
// TAPLLM_NO_AVX512BF16 stands for a CPU without AVX512-BF16 (tests run both paths on one machine).
inline bool bf16_hw() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool has = __builtin_cpu_supports("avx512bf16") && !std::getenv("TAPLLM_NO_AVX512BF16");
  return has;
#else
  return false;
#endif
}

// Whether attention may multiply bfloat16 with AVX512-BF16 dot products: the CPU runs vdpbf16ps
// and TAPLLM_BF16_DOT is not "0" (float32 products, for comparisons). CPUID is the right test:
// AVX512-BF16 works on the zmm state that the OS has already enabled for AVX512 (ATen's AVX512
// dispatch checks it); unlike AMX tiles, no further permission is asked of the kernel.
inline bool bf16_dot_supported() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool ok = [] {
    const char* env = std::getenv("TAPLLM_BF16_DOT");
    return __builtin_cpu_supports("avx512bf16") && !(env != nullptr && std::string(env) == "0") &&
           !std::getenv("TAPLLM_NO_AVX512BF16");
  }();
  return ok;
#else
  return false;
#endif
}

// ---- loads and stores in float32 ---------------------------------------------------------------
// W elements of T widened to float32.
template <typename T>
inline Vec loadf(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

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

// Runs f(std::true_type) when T is bfloat16 and the CPU converts it in hardware, else f(std::false_type):
// the HW template argument of the element-wise kernels.
template <typename T, typename F>
inline void with_bf16_hw(bool allowed, F&& f) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (allowed && bf16_hw()) return f(std::true_type());
  }
#else
  (void)allowed;
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
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    return bf16_round(v);
#endif
  } else {  // in registers: narrow (round to nearest even, as a store to T does) and widen back
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
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
// gives denormals and 0xffff. Such lanes are only noted (a branch per vector would cost a quarter
// of the kernel's time) and the caller redoes the row without HW, so the bits never differ.
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

// ---- exp ---------------------------------------------------------------------------------------
// at::vec's exp is a call into Sleef (u10), whose spills and range checks cost more than a whole
// SiLU or softmax step, so the kernels share this one polynomial: 2^f for |f| <= 1/2, a degree-6
// fit (relative error 2e-8). It is more accurate than Cephes' degree-5 fit of e^r: e^x through it
// is within 1.1e-7 (mean 0.28 ulp), through Cephes' within 1.2e-7 (0.35 ulp).
inline Vec exp2_poly(const Vec& f) {
  Vec p(1.54697322e-4f);
  p = at::vec::fmadd(p, f, Vec(1.34004327e-3f));
  p = at::vec::fmadd(p, f, Vec(9.61802527e-3f));
  p = at::vec::fmadd(p, f, Vec(5.55032715e-2f));
  p = at::vec::fmadd(p, f, Vec(2.40226507e-1f));
  p = at::vec::fmadd(p, f, Vec(6.93147182e-1f));
  return at::vec::fmadd(p, f, Vec(1.f));
}

// 2^t for t <= ~0 (scaled scores minus their running maximum): t = n + f with |f| <= 1/2. With
// Clamp, -inf and NaN (-inf - -inf) give 0; without, t must be finite (anything far below -126
// still gives 0). The generic build takes at::vec's exp2.
template <bool Clamp>
inline Vec exp2_neg(const Vec& t) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = Clamp ? _mm512_max_ps(t, _mm512_set1_ps(-200.f)) : __m512(t);  // NaN: max gives its 2nd operand
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_poly(_mm512_sub_ps(x, n)), n);  // 2^-200 underflows to 0
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 x = _mm256_max_ps(t, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // 2^n from its exponent bits; n = -127 gives the bits of 0
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp2_poly(_mm256_sub_ps(x, n)), _mm256_castsi256_ps(e));
#else
  const Vec x = Vec::blendv(Vec(-200.f), t, t > Vec(-200.f));
  return x.exp2();
#endif
}

// e^x for any x (SiLU): x = n ln2 + r by Cody-Waite's two-part ln2 (r exact enough for float32),
// then 2^n * 2^(r log2 e). scalef gives inf/0 past the float range; x is clamped so that +-inf
// give inf/0 and NaN stays NaN. Without AVX512 (no scalef): at::vec's exp.
inline Vec exp_fast(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = _mm512_min_ps(_mm512_set1_ps(150.f), _mm512_max_ps(_mm512_set1_ps(-150.f), v));  // NaN: x
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  return _mm512_scalef_ps(exp2_poly(_mm512_mul_ps(x, log2e)), n);
#else
  return v.exp();
#endif
}

// ---- paged rows ----------------------------------------------------------------------------
// The cache slot of position p (its row in the cache): block table[p / block_size], row p % block_size
// of it. A power-of-two block size (the default 16) takes shifts: a 64-bit division costs more than
// a key's dot products, and every key row is found this way.
inline int64_t paged_slot(const int64_t* table, int64_t p, int64_t block_size) {
  if ((block_size & (block_size - 1)) == 0) {
    const int shift = __builtin_ctzll(static_cast<uint64_t>(block_size));
    return (table[p >> shift] << shift) + (p & (block_size - 1));
  }
  return table[p / block_size] * block_size + p % block_size;
}

// The first position of position p's block.
inline int64_t block_start(int64_t p, int64_t block_size) {
  if ((block_size & (block_size - 1)) == 0) return p & ~(block_size - 1);
  return p / block_size * block_size;
}

// Asks for the rows [begin, end) of a paged cache ahead of use (row p lives in block table[p /
// block_size]): a sequence's blocks lie anywhere in the cache, so the hardware prefetcher, which
// follows strides, does not find them.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
template <typename T, int HINT = _MM_HINT_T0>
inline void prefetch_rows(const T* base, const int64_t* table, int64_t begin, int64_t end, int64_t block_size,
                          int64_t d) {
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t p = begin; p < end;) {  // a block's rows at a time: one address, then one run of lines
    const int64_t slot = paged_slot(table, p, block_size);
    const int64_t rows = std::min(end - p, block_size - (p - block_start(p, block_size)));
    const char* run = reinterpret_cast<const char*>(base + slot * d);
    for (int64_t b = 0; b < rows * row_bytes; b += 64) _mm_prefetch(run + b, static_cast<_mm_hint>(HINT));
    p += rows;
  }
}
#endif

}  // namespace tapllm
