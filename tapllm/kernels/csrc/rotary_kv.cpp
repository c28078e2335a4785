// Rotary embedding in place (rotary_) and the KV-cache write (kv_write): the two steps between the
// fused q/k/v projection and attention.
//
// Rotary: rotate-half layout on the first R dims of every head. cos/sin are rows [T, R] (one per
// token). In T (what the eager code casts them to) each product and the sum are rounded to T, as
// there; in float32 (OLMo-2) the rotation is computed in float32 and rounded once.
//
// KV write: rows of k and v into the caches [Hkv, blocks, block_size, D] at flat slots, V made
// finite (attention multiplies values by probabilities that may be 0, which must give 0, not NaN).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

#include "checks.h"
#include "kernels.h"
#include "vec_math.h"

namespace tapllm {
namespace {

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

template <typename T, typename C>
void rotary_both(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, int64_t rdim) {
  with_bf16_hw<T>(rdim <= kRotaryBuffer, [&](auto hw) {
    rotary_rows<T, C, decltype(hw)::value>(q.data_ptr<T>(), k.data_ptr<T>(), q.size(0), q.size(1), k.size(1),
                                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.data_ptr<C>(),
                                           sin.data_ptr<C>(), cos.stride(0), rdim);
  });
}

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

}  // namespace

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

}  // namespace tapllm
