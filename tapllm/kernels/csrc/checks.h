// Argument checks and the element-type dispatch shared by the element-wise and attention ops.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

// float32, bfloat16 and float16, with the element type as scalar_t in the body.
#define TAPLLM_DISPATCH(TYPE, NAME, ...)                                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace tapllm {

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

inline void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [T, heads, head_dim] with contiguous heads");
}

inline void check_cache(const at::Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4 && c.is_contiguous(), name, " must be a contiguous [Hkv, blocks, block_size, D] cache");
}

}  // namespace tapllm
