// The host functions of tapllm's fused CPU kernels (cpu_kernels.cpp), for the layer runner.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace tapllm {

using Vec = at::vec::Vectorized<float>;

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

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t mode);
at::Tensor add_rms_norm_(at::Tensor x, const at::Tensor& r, const at::Tensor& w, double eps, int64_t mode);
at::Tensor gated_act(const at::Tensor& gate_up, int64_t mode);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
void kv_write(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& lens, double scale, int64_t window,
                            double softcap);

// Whether attention may multiply bfloat16 with AVX512-BF16 dot products (cpu_kernels.cpp): the
// CPU runs vdpbf16ps and TAPLLM_BF16_DOT is not "0" (float32 products, for comparisons).
bool bf16_dot_supported();

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& contexts,
                             const at::Tensor& block_tables, double scale, int64_t window, double softcap);

// y = x W^T + b with W in quantized blocks (quant.cpp): uint8 [N, blocks, bytes per block].
// act_bits 8: the activations are rounded to int8 per run of 32 inputs first (quant_a8.cpp).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t act_bits = 0);
at::Tensor quant_linear_a8(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// y = x W^T + b for a few bf16 rows on a oneDNN-prepacked weight read in place (packed_gemv.cpp):
// w is the weight's packed_view.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

}  // namespace tapllm
